"""Run one simulation point and turn it into metric records and a summary."""

from __future__ import annotations

import time
from dataclasses import dataclass

from lab.sim.config import SimConfig
from lab.sim.engine import Simulation
from lab.workload.metrics import IterationRecord, RequestRecord, summarize
from lab.workload.traces.trace import TraceItem


@dataclass
class SimResult:
    config: SimConfig
    records: list[RequestRecord]
    iterations: list[IterationRecord]
    summary: dict
    wall_s: float


def request_records(sim: Simulation) -> list[RequestRecord]:
    out = []
    for item in sim.items:
        req = sim.requests[item.request_id]
        out.append(
            RequestRecord(
                item.request_id,
                req.arrival_time,
                req.num_prompt_tokens,
                list(req.token_times),
                first_scheduled_s=req.first_scheduled_time,
                finish_s=req.finished_time,
                completed=req.finish_reason in ("length", "stop"),
                slo_ttft_s=req.slo.ttft_s,
                slo_tbt_s=req.slo.tbt_s,
                slo_deadline_s=req.slo.deadline_s,
                num_preemptions=req.num_preemptions,
            )
        )
    return out


def simulate(items: list[TraceItem], config: SimConfig, profile: dict | None = None) -> SimResult:
    started = time.perf_counter()
    sim = Simulation(items, config, profile=profile).run()
    records = request_records(sim)
    summary = summarize(records, sim.iterations, reference_tokens=sim.cost.pivot_tokens)
    summary["num_swapped_blocks"] = sum(
        i.num_swap_out_blocks + i.num_swap_in_blocks for i in sim.iterations
    )
    if config.prefix_caching:
        stats = [e.scheduler.block_manager.cache_stats() for e in sim.executors]
        queries = sum(s["prefix_cache_queries"] for s in stats)
        hits = sum(s["prefix_cache_hits"] for s in stats)
        summary["prefix_cache_hits"] = hits
        summary["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        summary["prefix_cache_evictions"] = sum(s["prefix_cache_evictions"] for s in stats)
    if sim.forecasts is not None:  # the synthetic source's label says it is an ablation
        summary["forecasts"] = sim.forecasts.label
    wall = time.perf_counter() - started
    summary["sim_wall_s"] = wall
    return SimResult(config, records, sim.iterations, summary, wall)
