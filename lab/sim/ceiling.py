"""The ordering ceiling of a trace: the best `hybrid` configuration the simulator finds when it
knows every request's true length (oracle predictions), and its mean normalized latency.

A live benchmark point (its arrivals, prompt lengths and the served model's output lengths,
e.g. `bench/results/live_fixed256_rate1_trace.jsonl`) is replayed with the deployment's
profile under each configuration of `CEILING_GRID` (a concurrency limit, the rank, the token
budget); the lowest mean normalized latency is the ceiling that live `hybrid` is measured
against (issue: "wins >= 80% of the oracle-ceiling gain"), beside `fcfs` on the same trace.
"""

from __future__ import annotations

from itertools import product

from lab.sim.config import SimConfig
from lab.sim.run import simulate
from lab.workload.traces.trace import TraceItem

# gpu_job_limit (M: at most M jobs at a time, SRPT by rank past it) x rank x token budget
JOB_LIMITS: tuple[int | None, ...] = (None, 1, 2, 4, 8, 16, 32, 64)
RANKS = ("normalized", "remaining")
TOKEN_BUDGETS: tuple[int | None, ...] = (None, 128, 256)


def ceiling_grid() -> list[dict]:
    """Every hybrid knob set the ceiling search tries (defaults left out)."""
    grid = []
    for limit, rank, budget in product(JOB_LIMITS, RANKS, TOKEN_BUDGETS):
        knobs: dict = {"rank": rank}
        if limit is not None:
            knobs["gpu_job_limit"] = limit
        if budget is not None:
            knobs["token_budget"] = budget
        grid.append(knobs)
    return grid


def _score(items: list[TraceItem], config: SimConfig, profile: dict | None) -> dict:
    s = simulate(items, config, profile).summary
    return {
        "mean_normalized_latency": s["mean_normalized_latency"],
        "p99_tbt": s["p99_tbt"],
        "completed": s["completed"],
    }


def oracle_ceiling(
    items: list[TraceItem],
    base: SimConfig,
    profile: dict | None = None,
    grid: list[dict] | None = None,
) -> dict:
    """Simulate `hybrid` with oracle lengths under every knob set of `grid` (default
    `ceiling_grid()`) on `items`, and `fcfs` beside it. Returns the best knob set, its
    `ceiling_mean_normalized_latency`, fcfs's, and every configuration tried."""
    tried = []
    for knobs in grid if grid is not None else ceiling_grid():
        config = base.with_(policy="hybrid", knobs={**base.knobs, **knobs}, prediction="oracle")
        tried.append({"knobs": knobs, **_score(items, config, profile)})
    complete = [t for t in tried if t["completed"] == len(items)] or tried
    best = min(complete, key=lambda t: t["mean_normalized_latency"])
    fcfs = _score(items, base.with_(policy="fcfs", knobs={}, prediction="oracle"), profile)
    return {
        "ceiling_mean_normalized_latency": best["mean_normalized_latency"],
        "best_knobs": best["knobs"],
        "best_p99_tbt": best["p99_tbt"],
        "fcfs_mean_normalized_latency": fcfs["mean_normalized_latency"],
        "num_requests": len(items),
        "tried": tried,
    }
