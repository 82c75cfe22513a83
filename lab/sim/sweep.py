"""Sweeps: many (policy, rate) points over worker processes, then capacity by bisection.

A policy entry is `name[:knob=value,...][@prediction]`, e.g. `alise:memory=recompute`,
`sarathi:chunked=false`, `alise@noisy:sigma=1.0`: each ablation is one more entry.
Every point re-uses the same seeded arrival draws scaled to its rate, so curves are smooth.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass

from lab.sim.config import SimConfig, load_profile, parse_policy, prefill_attention_coeff
from lab.sim.engine import SimulationError
from lab.workload.capacity import Criterion, Search, bisect_many
from lab.workload.metrics import e2e, normalized_latency, ttft
from lab.workload.traces.spec import make_trace
from lab.workload.traces.trace import TraceItem

POINT_KEYS = (
    "mean_normalized_latency",
    "p99_tbt",
    "median_ttft",
    "slo_attainment",
    "goodput",
    "throughput_tok_s",
)


@dataclass(frozen=True)
class TraceSpec:
    workload: str = "sharegpt"
    num_requests: int = 2000
    arrival: str | None = None  # default: poisson (csv/jsonl: their own timestamps)
    burstiness: float = 1.0
    slo: str = "none"
    seed: int = 0


def policy_config(entry: str, base: SimConfig) -> SimConfig:
    spec, _, prediction = entry.partition("@")
    name, knobs = parse_policy(spec)
    return base.with_(
        policy=name, knobs={**base.knobs, **knobs}, prediction=prediction or base.prediction
    )


_PROFILES: dict[str, dict] = {}


def cached_profile(name: str) -> dict:
    """`load_profile`, once per process (the sweep's workers and the CLI share it)."""
    if name not in _PROFILES:
        _PROFILES[name] = load_profile(name)
    return _PROFILES[name]


def build_trace(
    spec: TraceSpec, rate: float | None, profile: dict, attn_s: float = 0.0
) -> list[TraceItem]:
    """The trace; SLO schemes see the lone-prefill time the simulator's clock will charge."""
    from services.scheduler.core.cost_model import CostModel

    cost = CostModel.from_profile(profile)

    def prefill_time(p: int) -> float:
        return cost.iteration_time(p, 0, p) + attn_s * p * (p + 1) / 2

    return make_trace(
        spec.workload,
        spec.num_requests,
        rate,
        spec.arrival,
        spec.burstiness,
        spec.slo,
        spec.seed,
        prefill_time=prefill_time,
    )


def run_point(task: tuple) -> dict:
    """Worker: (policy entry, rate, base config, trace spec, keep_cdf) -> point dict."""
    from lab.sim.run import simulate

    entry, rate, base, spec, keep_cdf = task
    config = policy_config(entry, base)
    profile = cached_profile(config.profile)
    items = build_trace(spec, rate, profile, prefill_attention_coeff(config, profile))
    try:
        result = simulate(items, config, profile)
    except SimulationError as exc:  # a stalled or runaway policy: a failed point, not a crash
        return {
            "policy": entry,
            "rate": rate,
            "error": str(exc),
            "num_requests": len(items),
            "completed": 0,
            **{k: None for k in POINT_KEYS},
        }
    point = {"policy": entry, "rate": rate, **result.summary}
    if keep_cdf:
        done = [r for r in result.records if r.completed and r.token_times]
        point["cdf"] = {
            "normalized_latency": sorted(normalized_latency(r) for r in done),
            "ttft": sorted(ttft(r) for r in done),
            "e2e": sorted(e2e(r) for r in done),
        }
    return point


def _run_tasks(tasks: list[tuple], jobs: int, desc: str) -> list[dict]:
    from tqdm import tqdm

    if jobs <= 1 or len(tasks) <= 1:
        return [run_point(t) for t in tqdm(tasks, desc=desc, leave=False)]
    with mp.get_context("fork").Pool(min(jobs, len(tasks))) as pool:
        return list(tqdm(pool.imap(run_point, tasks), total=len(tasks), desc=desc, leave=False))


def sweep(
    policies: list[str],
    rates: list[float],
    base: SimConfig,
    spec: TraceSpec,
    criteria: list[Criterion] = (),
    jobs: int | None = None,
    rel_tol: float = 0.05,
    max_rounds: int = 4,
    cdf_rate: float | None = None,
) -> dict:
    """Grid points for every (policy, rate), then a bisection per policy and criterion."""
    started = time.perf_counter()
    jobs = jobs or os.cpu_count() or 1
    for entry in policies:
        policy_config(entry, base)  # fail fast on a malformed entry
    build_trace(spec, rates[0], cached_profile(base.profile))  # load data once, before forking
    tasks = [(p, r, base, spec, r == cdf_rate) for p in policies for r in rates]
    points = _run_tasks(tasks, jobs, "grid")
    cache = {(p["policy"], p["rate"]): p for p in points}
    searches = [Search(p, c) for p in policies for c in criteria]
    for s in searches:
        for r in rates:
            s.observe(r, cache[(s.key, r)])

    def evaluate_all(keys):
        todo = [k for k in keys if k not in cache]
        for point in _run_tasks([(p, r, base, spec, False) for p, r in todo], jobs, "bisect"):
            cache[(point["policy"], point["rate"])] = point
            points.append(point)
        return {k: cache[k] for k in keys}

    bisect_many(searches, evaluate_all, rel_tol, max_rounds)
    return _results(points, searches, base, spec, criteria, time.perf_counter() - started)


def _results(points, searches, base, spec, criteria, wall_s) -> dict:
    cdf = {p["policy"]: {"rate": p["rate"], **p.pop("cdf")} for p in points if "cdf" in p}
    capacity, detail = {}, {}
    for s in searches:
        capacity.setdefault(s.key, {})[s.criterion.name] = s.result()["capacity"]
        detail.setdefault(s.key, {})[s.criterion.name] = s.result()
    points.sort(key=lambda p: (p["policy"], p["rate"]))
    return {
        "points": points,
        "capacity": capacity,
        "capacity_detail": detail,
        "criteria": {c.name: asdict(c) for c in criteria},
        "cdf": cdf,
        "config": asdict(base),
        "trace": asdict(spec),
        "wall_s": wall_s,
    }
