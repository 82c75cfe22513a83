"""Fidelity: does the simulator, given a measured profile, predict the real executor?

`live_run` drives the real in-process `Engine` with the core `Scheduler` on the wall clock
(requests join at their trace arrival times, token times are real); `check` runs the same
trace through the simulator with the engine's KV pool and the profile from
`alise executor profile`, and reports the relative error of mean E2E latency and P99 TBT, for
the default clock (the fit corrected by the profile's measured samples) and the fit alone.
"""

from __future__ import annotations

import time
from collections import deque

from lab.sim.config import SimConfig
from lab.workload.metrics import RequestRecord, summarize
from lab.workload.traces.trace import TraceItem
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.policies import make_policy
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler

COMPARED = ("mean_e2e", "p99_tbt", "mean_ttft", "median_tbt")


def _request(item: TraceItem, tokenizer) -> Request:
    ids = [1] * item.prompt_len
    if item.prompt and tokenizer is not None:
        ids = tokenizer(item.prompt, add_special_tokens=False)["input_ids"] or ids
    return Request(
        item.request_id,
        ids,
        item.output_len,
        item.arrival_s,
        ignore_eos=True,
        predicted_len=item.output_len,
        prediction_source="oracle",
        true_len=item.output_len,
    )


def _step(engine, sched, out, start: float) -> None:
    result = engine.step(out)
    sched.update(result.outcome(), time.perf_counter() - start)


def live_run(
    engine, items: list[TraceItem], policy: str, profile: dict, tokenizer=None
) -> list[RequestRecord]:
    """Serve the trace on the real engine; times are seconds since the run started."""
    bm = BlockManager(engine.num_device_blocks, engine.num_host_blocks, engine.block_size)
    sched = Scheduler(
        make_policy(policy), bm, CostModel.from_profile(profile), engine.max_model_len
    )
    reqs = [_request(i, tokenizer) for i in items]
    pending = deque(sorted(reqs, key=lambda r: r.arrival_time))
    start = time.perf_counter()
    while pending or sched.has_unfinished:
        now = time.perf_counter() - start
        while pending and pending[0].arrival_time <= now:
            sched.admit(pending.popleft())
        out = sched.schedule(now)
        if out.is_empty:
            if pending:
                time.sleep(max(0.0, pending[0].arrival_time - (time.perf_counter() - start)))
            continue
        _step(engine, sched, out, start)
    out = sched.schedule(time.perf_counter() - start)  # the last requests' frees
    if not out.is_empty:
        _step(engine, sched, out, start)
    return [
        RequestRecord(
            r.request_id,
            r.arrival_time,
            r.num_prompt_tokens,
            list(r.token_times),
            r.first_scheduled_time,
            r.finished_time,
        )
        for r in reqs
    ]


def check(engine, items: list[TraceItem], policy: str, profile_path: str, tokenizer=None) -> dict:
    import json
    from pathlib import Path

    from lab.sim.run import simulate

    profile = json.loads(Path(profile_path).read_text())
    real = summarize(live_run(engine, items, policy, profile, tokenizer))
    config = SimConfig(
        policy=policy,
        profile=str(profile_path),
        num_device_blocks=engine.num_device_blocks,
        num_host_blocks=engine.num_host_blocks,
        block_size=engine.block_size,
        max_model_len=engine.max_model_len,
    )
    report = {"policy": policy, "requests": len(items), "real": {k: real[k] for k in COMPARED}}
    for clock in ("measured", "fit"):  # headline: the default clock; the fit for scale
        sim = simulate(items, config.with_(clock=clock), profile).summary
        suffix = "" if clock == "measured" else "_fit_clock"
        report["sim" + suffix] = {k: sim[k] for k in COMPARED}
        report["relative_error" + suffix] = {
            k: (sim[k] - real[k]) / real[k] for k in COMPARED if real.get(k)
        }
    errors = report["relative_error"]
    report["within_15pct"] = all(
        abs(errors[k]) <= 0.15 for k in ("mean_e2e", "p99_tbt") if k in errors
    )
    return report
