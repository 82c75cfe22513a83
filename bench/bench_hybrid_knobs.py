"""`alise bench hybrid-knobs`: what each knob of the `hybrid` policy that no paper names does.

Every knob in `ALTERNATIVES` is set to each of its alternative values, one knob at a time, and
simulated (`alise sim run`'s code path: `lab.sim.sweep.run_point`, the same
scheduling core serving runs) at `POINTS`: the mixed long/short workload with heterogeneous
SLOs and ShareGPT, each near and past hybrid's capacity, noisy predictions (sigma 1.0). The
noise band of a metric at a point is how far the default moves when only the seed (arrivals,
lengths, prediction errors) changes. Verdict per knob: `identical` (no alternative changes any
metric at any point), `within noise` (no change beyond the band), `effect` (some change beyond
it). The knobs a paper names (README's "Policy knobs" table) are kept unmeasured; `CUT` lists
the knobs removed after this measurement (bench/results/hybrid_knob_effects.json keeps their
figures, taken at the commit it names, before the cut).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

from lab.workload.report import emit_json

METRICS = (
    "mean_normalized_latency",
    "p99_tbt",
    "slo_attainment",
    "iteration_slo_attainment",
    "goodput",
    "throughput_tok_s",
)
MIXED = {"trace": "mixed:long_share=0.35", "slo": "heterogeneous", "attention": -1.0}
SHAREGPT = {"trace": "sharegpt", "slo": "heterogeneous", "attention": None}
POINTS = (  # hybrid's capacity: about 0.75 req/s on mixed, 27 req/s on ShareGPT
    {**MIXED, "rate": 0.75},
    {**MIXED, "rate": 1.0},
    {**SHAREGPT, "rate": 22.0},
    {**SHAREGPT, "rate": 40.0},
)
ALTERNATIVES: dict[str, list] = {
    "max_num_seqs": [64],
    "max_skips": [4, 256],
    "queue_base_s": [0.05, 0.5],
    "queue_ratio": [1.5, 4.0],
    "rank": ["remaining"],
    "rank_ref_len": [4, 64],
    "tbt_slo_s": [0.1],
    "slo_aware_budget": [False],
    "prefill_lane": [False],
    "lane_max_misses": [0, 4],
    "max_long_prompts": [2, 4],
    "max_window": [4, 64],
    "preempt_level_gap": [1, 4, None],
}
CUT = {  # measured with these alternatives, verdict `identical`, then removed from the code
    "t_max_window": [4, 256],  # now hybrid.T_MAX_WINDOW = 32
    # cut when policies became compositions (each keeps its part's default: levels.LevelRule,
    # memory.MemoryRule, ranking.RankRule); alise and fastserve keep them as knobs
    "aging_per_step": [8, None],  # 64
    "prefetch_per_step": [1, 16],  # 4
    "default_predicted_len": [64, 1024],  # 256
}
PAPER_KNOBS = (  # README "Policy knobs": kept whatever they measure
    "token_budget",
    "tile_size",
    "long_prompt_tokens",
    "num_queues",
    "aging_threshold_s",
    "gpu_job_limit",
    "era",
    "memory_mode",
    "watermark",
)
NOISE_SEEDS = (1, 2)


def point_name(point: dict) -> str:
    return f"{point['trace']}@{point['rate']:g}"


def entry(knob: str | None, value: object = None) -> str:
    """The `alise sim run --policy` entry of hybrid with one knob set (None: the defaults)."""
    if knob is None:
        return "hybrid"
    text = value if isinstance(value, str) else json.dumps(value)
    return f"hybrid:{knob}={text}"


def _task(policy: str, point: dict, num_requests: int, seed: int) -> tuple:
    """A `run_point` task: `alise sim run --policy POLICY --rate R --trace T --slo S
    --prediction noisy:sigma=1.0 --num-requests N --seed SEED` (mixed: --prefill-attention
    auto)."""
    from lab.sim.config import SimConfig
    from lab.sim.sweep import TraceSpec

    mixed = point["trace"].startswith("mixed")
    base = SimConfig(
        max_model_len=34816 if mixed else 4096,
        prediction="noisy:sigma=1.0",
        prefill_attention_s=point["attention"],
        seed=seed,
    )
    spec = TraceSpec(point["trace"], num_requests, None, 1.0, point["slo"], seed)
    return (policy, point["rate"], base, spec, False)


def _simulate(tasks: list[tuple], jobs: int) -> list[dict]:
    from lab.sim.sweep import run_point

    if jobs <= 1:
        return [run_point(t) for t in tasks]
    with mp.get_context("fork").Pool(jobs) as pool:
        return pool.map(run_point, tasks)


def measure(
    alternatives: dict[str, list], points: tuple, num_requests: int, jobs: int = 1
) -> dict[tuple[str, str, int], dict]:
    """{(policy entry, point name, seed): metrics} for the defaults (every seed) and each
    alternative (seed 0)."""
    keys = [(entry(None), p, s) for p in points for s in (0, *NOISE_SEEDS)]
    keys += [(entry(k, v), p, 0) for k, vs in alternatives.items() for v in vs for p in points]
    out = _simulate([_task(e, p, num_requests, s) for e, p, s in keys], jobs)
    return {
        (e, point_name(p), s): {m: r.get(m) for m in METRICS}
        for (e, p, s), r in zip(keys, out, strict=True)
    }


def noise(results: dict, points: tuple) -> dict[str, dict[str, float]]:
    """Per point and metric: the largest move of the default when only the seed changes."""
    band: dict[str, dict[str, float]] = {}
    for p in map(point_name, points):
        ref = results[(entry(None), p, 0)]
        runs = [results[(entry(None), p, s)] for s in NOISE_SEEDS]
        band[p] = {m: max(abs((r[m] or 0.0) - (ref[m] or 0.0)) for r in runs) for m in METRICS}
    return band


def judge(knob: str, values: list, results: dict, band: dict, points: tuple) -> dict:
    """One knob's figures: metrics per alternative and point, the largest change of each
    metric as a share of its noise band, and the verdict."""
    figures: dict[str, dict] = {}
    worst = {m: 0.0 for m in METRICS}
    identical = True
    for v in values:
        per_point = figures.setdefault(entry(knob, v), {})
        for p in map(point_name, points):
            alt, ref = results[(entry(knob, v), p, 0)], results[(entry(None), p, 0)]
            per_point[p] = alt
            for m in METRICS:
                diff = abs((alt[m] or 0.0) - (ref[m] or 0.0))
                identical = identical and alt[m] == ref[m]
                share = diff / band[p][m] if band[p][m] else (0.0 if diff == 0 else float("inf"))
                worst[m] = max(worst[m], share)
    if identical:
        verdict = "identical"
    elif max(worst.values()) <= 1.0:
        verdict = "within noise"
    else:
        verdict = "effect"
    return {"alternatives": figures, "max_change_in_noise_bands": worst, "verdict": verdict}


def paired(alternatives: dict[str, list], point: dict, seeds: int, num_requests: int, jobs: int):
    """A closer look at one point: the defaults and every alternative at the same `seeds`
    seeds, {policy entry: {seed: metrics and swapped blocks}}; a change that keeps its sign
    from seed to seed is an effect even when it is smaller than the noise band."""
    entries = [entry(None)] + [entry(k, v) for k, vs in alternatives.items() for v in vs]
    keys = [(e, s) for s in range(seeds) for e in entries]
    out = _simulate([_task(e, point, num_requests, s) for e, s in keys], jobs)
    figures: dict[str, dict[str, dict]] = {}
    for (e, s), r in zip(keys, out, strict=True):
        row = {m: r.get(m) for m in (*METRICS, "num_swapped_blocks", "num_preemptions")}
        figures.setdefault(e, {})[str(s)] = row
    return {"point": point_name(point), "figures": figures}


def report(alternatives: dict[str, list], points: tuple, num_requests: int, jobs: int) -> dict:
    started = time.perf_counter()
    results = measure(alternatives, points, num_requests, jobs)
    band = noise(results, points)
    names = [point_name(p) for p in points]
    return {
        "points": names,
        "num_requests": num_requests,
        "prediction": "noisy:sigma=1.0",
        "metrics": list(METRICS),
        "default": {p: results[(entry(None), p, 0)] for p in names},
        "noise_seeds": list(NOISE_SEEDS),
        "noise_band": band,
        "knobs": {k: judge(k, vs, results, band, points) for k, vs in alternatives.items()},
        "paper_knobs_kept": list(PAPER_KNOBS),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _run(args: argparse.Namespace) -> int:
    knobs = args.knobs.split(",") if args.knobs else list(ALTERNATIVES)
    unknown = sorted(set(knobs) - set(ALTERNATIVES))
    if unknown:
        raise SystemExit(f"unknown knob(s) {unknown}; measured: {sorted(ALTERNATIVES)}")
    points = POINTS[: args.points]
    alternatives = {k: ALTERNATIVES[k] for k in knobs}
    if args.paired_seeds:
        result = paired(alternatives, points[0], args.paired_seeds, args.num_requests, args.jobs)
    else:
        result = report(alternatives, points, args.num_requests, args.jobs)
    emit_json(result, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "hybrid-knobs", help="simulated effect of each hybrid knob that no paper names"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--num-requests", type=int, default=1000, help="requests per point")
    p.add_argument("--points", type=int, default=len(POINTS), help="the first N points")
    p.add_argument("--knobs", default="", help="comma-separated (default: all measured)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument(
        "--paired-seeds",
        type=int,
        default=0,
        help="instead: defaults and alternatives at seeds 0..N-1 of the first point",
    )
    p.set_defaults(func=_run)
