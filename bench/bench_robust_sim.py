"""`alise bench robust-sim`: hybrid's defaults against fcfs in the simulator, on traces served
live, with the predictions the live runs were served, no prediction at all, and oracle lengths.

The traces are live runs' own (arrivals as sent, prompt and output lengths as served, one cap
of 256, EOS honoured; `bench/results/live_progressive_replay/`), their arrivals rescaled to the
asked rates; the profile is the one the CPU executor serves with. Each hybrid configuration
runs with three prediction sources: `served` (the arrival predictions and the probe's
forecasts the live run made, replayed), `prior` (every request the same prior length: no
information) and `oracle` (true lengths: the ceiling). A configuration is robust when it beats
fcfs with `prior` too, so that bad predictions cannot make it lose.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.cli import command_line

REPLAY = Path("bench/results/live_progressive_replay")
TRACES = ("hybrid-t1-r3-0", "hybrid-t0-r3-0", "hybrid-t1-r1-0", "hybrid-t0-r1-0")
# (label, knobs): today's defaults, the defaults before the step-time curve, and variations
CONFIGS = (
    ("defaults", {}),
    ("before: tau 512", {"efficiency": None}),
    ("curve limit (0.9)", {"job_limit_efficiency": 0.9}),
    ("limit 31 that pauses by rank", {"gpu_job_limit": 31}),
    ("curve limit (0.8)", {"job_limit_efficiency": 0.8}),
    ("curve limit (0.95)", {"job_limit_efficiency": 0.95}),
)
SOURCES = ("served", "prior", "oracle")


def rows_at(name: str, rate: float) -> list[dict]:
    """The trace's rows with arrivals rescaled to `rate` requests/s."""
    rows = [json.loads(line) for line in (REPLAY / f"trace-{name}.jsonl").read_text().splitlines()]
    span = rows[-1]["arrival_s"] or 1.0
    scale = (len(rows) - 1) / rate / span
    return [{**r, "arrival_s": r["arrival_s"] * scale} for r in rows]


def simulate(rows: list[dict], policy: str, knobs: dict, profile: Path, prediction: str) -> dict:
    from bench.live_ceiling import trace_items
    from lab.sim.config import SimConfig
    from lab.sim.run import simulate as run

    config = SimConfig(policy=policy, knobs=knobs, profile=str(profile), prediction=prediction)
    s = run(trace_items(rows), config).summary
    return {"mean_normalized_latency": round(s["mean_normalized_latency"], 4),
            "p99_tbt_s": round(s["p99_tbt"], 4)}  # fmt: skip


def point(name: str, rate: float, profile: Path) -> dict:
    rows = rows_at(name, rate)
    served = f"file:{REPLAY}/predictions-{name}.jsonl+replay:{REPLAY}/forecasts-{name}.jsonl"
    specs = {"served": served, "prior": "prior", "oracle": "oracle"}
    fcfs = simulate(rows, "fcfs", {}, profile, "oracle")
    out: dict = {"trace": name, "rate": rate, "fcfs": fcfs, "hybrid": {}}
    for label, knobs in CONFIGS:
        got = {src: simulate(rows, "hybrid", knobs, profile, specs[src]) for src in SOURCES}
        for figures in got.values():
            figures["over_fcfs"] = round(
                figures["mean_normalized_latency"] / fcfs["mean_normalized_latency"], 3
            )
        out["hybrid"][label] = {"knobs": knobs, **got}
    return out


def _run(args: argparse.Namespace) -> int:
    from bench.live_ceiling import served_profile

    profile = Path(args.profile) if args.profile else served_profile()
    rates = [float(r) for r in args.rates.split(",")]
    points = [point(name, rate, profile) for name in TRACES for rate in rates]
    result = {"command": command_line("robust-sim"),
              "profile": str(profile), "kind": "simulator (live traces and predictions replayed)",
              "points": points}  # fmt: skip
    from bench.bench_engine import _emit

    return _emit(result, args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "robust-sim", help="hybrid's defaults vs fcfs in the simulator on served live traces"
    )
    p.add_argument("--rates", default="1,4", help="requests/s the traces are rescaled to")
    p.add_argument("--profile", default=None, help="default: the served CPU profile")
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run)
