"""The ordering ceiling of one live run: its own trace (arrivals as sent, prompt and output
lengths as served) in the simulator with the machine's CPU profile and oracle lengths, at the
best `hybrid` configuration of a small grid (token budget x GPU job limit M), beside `fcfs` on
the same trace. What ordering alone could win on that trace; the live hybrid's share of it is
issue 30's acceptance figure.

The grid is today's simulator API (`services.scheduler.sim.run.simulate`). When the
simulator grows its own search for the best oracle configuration, `best_hybrid` should call it
instead (the one place to change).
"""

from __future__ import annotations

import time
from pathlib import Path

PROFILE = Path("services/executor/profiles/cpu-smollm2-135m-bf16.json")
TOKEN_BUDGETS = (128, 256, 512)
JOB_LIMITS = (None, 4, 8, 16, 32)  # M: jobs on the device at once; None: memory decides


def trace_items(rows: list[dict]):
    """TraceItems from a run's trace rows (`bench_live_progressive.trace_rows`)."""
    from services.workload.traces.trace import TraceItem

    return [
        TraceItem(r["request_id"], r["arrival_s"], r["prompt_len"], r["output_len"]) for r in rows
    ]


def simulate_mnl(rows: list[dict], policy: str, knobs: dict, profile: Path) -> float:
    """Mean normalized latency of `policy` with `knobs` on the rows, oracle lengths."""
    from services.scheduler.sim.config import SimConfig
    from services.scheduler.sim.run import simulate

    config = SimConfig(policy=policy, knobs=knobs, profile=str(profile), prediction="oracle")
    return float(simulate(trace_items(rows), config).summary["mean_normalized_latency"])


def best_hybrid(rows: list[dict], profile: Path = PROFILE) -> dict:
    """{ceiling_mean_normalized_latency, ceiling_config, sim_fcfs_mean_normalized_latency,
    ceiling_gain (1 - ceiling / sim fcfs), ceiling_grid, ceiling_s} for one run's trace."""
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
        "ceiling_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
