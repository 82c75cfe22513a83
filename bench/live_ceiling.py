"""The ordering ceiling of one live run: its own trace (arrivals as sent, prompt and output
lengths as served) in the simulator with the machine's CPU profile and oracle lengths, at the
best `hybrid` configuration of a small grid (token budget x GPU job limit M), beside `fcfs` on
the same trace. What ordering alone could win on that trace; the live hybrid's share of it is
issue 30's acceptance figure.

`best_hybrid` calls the simulator's own search for the best oracle configuration
(`lab.sim.ceiling.oracle_ceiling`, its grid: concurrency limit x rank x token
budget) where the simulator has it; otherwise it searches the small grid here with today's
simulator API (`lab.sim.run.simulate`). Either way the keys are the same and
`ceiling_search` says which ran.
"""

from __future__ import annotations

import time
from pathlib import Path

TOKEN_BUDGETS = (128, 256, 512)
JOB_LIMITS = (None, 4, 8, 16, 32)  # M: jobs on the device at once; None: memory decides


def served_profile() -> Path:
    """The profile a CPU executor with this machine's settings serves with: its
    `profile_path`, else the bundled one of its model, dtype and weight format."""
    import torch

    from services.common.models import weights_dir
    from services.common.settings import ExecutorSettings
    from services.executor.config import resolve_dtype
    from services.executor.engine import bundled_profile_path
    from services.executor.runner import resolve_quantization

    s, cpu = ExecutorSettings(), torch.device("cpu")
    if s.profile_path:
        return Path(s.profile_path)
    dtype = str(resolve_dtype(s.dtype, cpu)).removeprefix("torch.")
    weights = resolve_quantization(s.quantization, weights_dir(s.model, s.data_dir), cpu)
    path = bundled_profile_path("cpu", s.model, dtype, None if weights == "none" else weights)
    if path is None:
        raise SystemExit(f"no bundled CPU profile for {s.model} ({dtype}, {weights})")
    return path


def trace_items(rows: list[dict]):
    """TraceItems from a run's trace rows (`bench_live_progressive.trace_rows`)."""
    from lab.workload.traces.trace import TraceItem

    return [
        TraceItem(r["request_id"], r["arrival_s"], r["prompt_len"], r["output_len"]) for r in rows
    ]


def simulate_mnl(
    rows: list[dict], policy: str, knobs: dict, profile: Path, prediction: str = "oracle"
) -> float:
    """Mean normalized latency of `policy` with `knobs` on the rows (oracle lengths, or the
    simulator's `prediction` spec)."""
    from lab.sim.config import SimConfig
    from lab.sim.run import simulate

    config = SimConfig(policy=policy, knobs=knobs, profile=str(profile), prediction=prediction)
    return float(simulate(trace_items(rows), config).summary["mean_normalized_latency"])


def best_hybrid(rows: list[dict], profile: Path) -> dict:
    """{ceiling_mean_normalized_latency, ceiling_config, sim_fcfs_mean_normalized_latency,
    ceiling_gain (1 - ceiling / sim fcfs), ceiling_grid, ceiling_search, ceiling_s} for one
    run's trace."""
    try:
        from lab.sim.ceiling import oracle_ceiling  # type: ignore[import-not-found]
    except ImportError:
        return local_grid(rows, profile)
    from lab.sim.config import SimConfig

    started = time.monotonic()
    got = oracle_ceiling(trace_items(rows), SimConfig(profile=str(profile)))
    ceiling, fcfs = got["ceiling_mean_normalized_latency"], got["fcfs_mean_normalized_latency"]
    return {
        "ceiling_mean_normalized_latency": ceiling,
        "ceiling_config": {"policy": "hybrid", **got["best_knobs"], "prediction": "oracle",
                           "profile": str(profile)},
        "sim_fcfs_mean_normalized_latency": fcfs,
        "ceiling_gain": 1.0 - ceiling / fcfs if fcfs else None,
        "ceiling_grid": {",".join(f"{k}={v}" for k, v in t["knobs"].items()):
                         round(t["mean_normalized_latency"], 5) for t in got["tried"]},
        "ceiling_search": "lab.sim.ceiling.oracle_ceiling",
        "ceiling_s": round(time.monotonic() - started, 1),
    }  # fmt: skip


def local_grid(rows: list[dict], profile: Path) -> dict:
    """`best_hybrid` over this module's grid (token budget x job limit, rank `normalized`)."""
    started = time.monotonic()
    grid = {}
    for budget in TOKEN_BUDGETS:
        for limit in JOB_LIMITS:
            knobs = {"token_budget": budget, "gpu_job_limit": limit}
            label = f"token_budget={budget},gpu_job_limit={limit}"
            grid[label] = (simulate_mnl(rows, "hybrid", knobs, profile), knobs)
    best = min(grid, key=lambda k: grid[k][0])
    fcfs = simulate_mnl(rows, "fcfs", {}, profile)
    ceiling = grid[best][0]
    return {
        "ceiling_mean_normalized_latency": ceiling,
        "ceiling_config": {"policy": "hybrid", **grid[best][1], "prediction": "oracle",
                           "profile": str(profile)},
        "sim_fcfs_mean_normalized_latency": fcfs,
        "ceiling_gain": 1.0 - ceiling / fcfs if fcfs else None,
        "ceiling_grid": {k: round(v[0], 5) for k, v in grid.items()},
        "ceiling_search": "bench.live_ceiling.local_grid",
        "ceiling_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
