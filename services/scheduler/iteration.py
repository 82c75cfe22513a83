"""What one loop iteration changes, as one `IterationWrite`; finishing a request; gauges.

Token events and final events are published from the write's callbacks, i.e. only after Redis
committed them.
"""
from __future__ import annotations

import json
import logging
import time
from functools import partial

from services.scheduler.convert import usage_pb
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.policies.base import make_policy
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.records import FINAL_STATUS, queue_of
from services.scheduler.store import IterationWrite
from services.scheduler.streams import final_event

log = logging.getLogger(__name__)

# Used when an executor reports no profile: a small CPU model's rough per-iteration costs.
DEFAULT_COSTS = {"c0": 0.005, "c_prefill": 5e-5, "c_decode": 2e-4, "c_context": 1e-7}


def cost_model_for(info) -> CostModel:
    if info.profile_json:
        try:
            profile = json.loads(info.profile_json)
            # the pool this executor has now, not the one it had when it was profiled
            pool = {"block_size": info.block_size, "num_device_blocks": info.num_device_blocks,
                    "num_host_blocks": info.num_host_blocks}
            profile.update({k: v for k, v in pool.items() if v})
            return CostModel.from_profile(profile)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("executor profile unusable, using defaults", extra={"error": str(exc)})
    return CostModel(**DEFAULT_COSTS, block_size=info.block_size,
                     num_device_blocks=info.num_device_blocks)


def make_scheduler(policy: str, knobs: dict, info) -> Scheduler:
    bm = BlockManager(info.num_device_blocks, info.num_host_blocks, info.block_size)
    return Scheduler(make_policy(policy, **knobs), bm, cost_model_for(info), info.max_model_len)


def fit_to_executor(req, info) -> None:
    """Limits learned from the executor, for requests admitted before any executor answered."""
    if req.max_model_len is None or req.max_model_len > info.max_model_len:
        req.max_model_len = info.max_model_len
    if not req.eos_token_ids:
        req.eos_token_ids = tuple(info.eos_token_ids)


def add_request(sched, req) -> None:
    """Add `req` to a core scheduler, also when it already has output tokens (re-admitted after
    its KV was lost): the core sends all known tokens as the new request's tokens."""
    if not req.output_token_ids:
        sched.add_request(req)
        return
    kept = req.output_token_ids, req.output_logprobs, req.token_times
    req.output_token_ids, req.output_logprobs, req.token_times = [], [], []
    try:
        sched.add_request(req)
    finally:
        req.output_token_ids, req.output_logprobs, req.token_times = kept


def budget_fields(loop) -> dict:
    info, sched = loop.info, loop.sched
    fields = {"up": int(loop.up), "instance_id": info.instance_id if info else "",
              "updated": time.time()}
    if info is not None:
        bm = sched.block_manager if sched is not None else None
        fields.update(
            num_device_blocks=info.num_device_blocks, num_host_blocks=info.num_host_blocks,
            free_device_blocks=bm.num_free_device_blocks if bm else info.num_device_blocks,
            free_host_blocks=bm.num_free_host_blocks if bm else info.num_host_blocks)
    return fields


def write_status(entry, w: IterationWrite) -> None:
    req = entry.req
    if req.status != entry.written_status and not req.status.is_finished:
        w.set(req.request_id, status=req.status.value)
        w.move(req.request_id, queue_of(req.status), req.arrival_time)
        entry.written_status = req.status


def record(service, loop, out, updates, result) -> IterationWrite:
    """The Redis write (and metrics) of one completed Step."""
    w, addr, now, m = IterationWrite(), loop.address, time.time(), service.metrics
    new_ids = {nr.request_id for nr in out.new_requests}
    for rid in new_ids:
        service.backlog_pop(rid)
        w.held_add[addr].add(rid)
        w.set(rid, executor=addr)
    w.held_remove[addr].update(set(out.free_request_ids) - new_ids)
    _forget_finished(loop.sched, out.free_request_ids)
    touched = set(out.num_scheduled_tokens).union(out.preempted_request_ids)
    touched.update(u.request_id for u in updates)
    for rid in touched:
        entry = service.entries.get(rid)
        if entry is None or entry.final:
            continue
        req = entry.req
        if req.first_scheduled_time is not None and not entry.first_sched_written:
            entry.first_sched_written = True
            w.set(rid, first_scheduled=req.first_scheduled_time)
            m.queue_time.observe(max(0.0, req.first_scheduled_time - req.arrival_time))
        write_status(entry, w)
    _tokens(service, w, updates)
    for u in updates:
        entry = service.entries.get(u.request_id)
        if u.finished and entry is not None and not entry.final:
            finalize(service, entry, u.finish_reason or "stop", w, now)
    if out.preempted_request_ids:
        w.counters["preemptions"] += len(out.preempted_request_ids)
        m.preemptions.inc(len(out.preempted_request_ids))
        for rid in out.preempted_request_ids:
            entry = service.entries.get(rid)
            if entry is not None and not entry.final:
                w.set(rid, num_preemptions=entry.req.num_preemptions)
    m.swap_out.inc(len(out.swap_out))
    m.swap_in.inc(len(out.swap_in))
    m.iteration_tokens.observe(out.total_num_scheduled_tokens)
    w.executors[addr] = budget_fields(loop)
    return w


def _forget_finished(sched, freed: list[str]) -> None:
    """Drop finished requests from the core once the executor was told to free them (the
    core keeps every request it ever saw otherwise)."""
    for rid in freed:
        req = sched.requests.get(rid)
        if req is not None and req.is_finished:
            del sched.requests[rid]


def _tokens(service, w: IterationWrite, updates) -> None:
    m, gained = service.metrics, 0
    for u in updates:
        entry = service.entries.get(u.request_id)
        if u.token is None or entry is None or entry.final:
            continue
        token_id, logprob, index = u.token
        times = entry.req.token_times
        t = times[index] if index < len(times) else time.time()
        w.add_token(u.request_id, index, token_id, logprob, t)
        entry.n_out = index + 1
        w.callbacks.append(partial(entry.stream.publish, index, [(token_id, logprob, t)]))
        gained += 1
        if index == 0:
            m.ttft.observe(max(0.0, t - entry.req.arrival_time))
        elif index - 1 < len(times):
            m.itl.observe(max(0.0, t - times[index - 1]))
    m.generation_tokens.inc(gained)


def finalize(service, entry, reason: str, w: IterationWrite, now: float, error: str = "") -> None:
    """Write the final state; publish the final event and forget the entry after commit."""
    entry.final = True
    req, rid = entry.req, entry.req.request_id
    service.pending.pop(rid, None)
    service.backlog_pop(rid)
    n_out = entry.n_out          # tokens recorded; an abort may land before a Step is recorded
    w.set(rid, status=FINAL_STATUS[reason].value, finish_reason=reason, finished_at=now,
          error=error, num_preemptions=req.num_preemptions)
    w.finish(rid)
    w.counters["aborted" if reason == "abort" else "finished"] += 1
    usage = usage_pb(req.num_prompt_tokens, n_out, req.arrival_time, req.first_scheduled_time,
                     req.token_times[0] if req.token_times else None, now, req.num_preemptions)
    event = final_event(rid, n_out, reason, usage, error)

    def publish() -> None:
        entry.stream.finish(event)
        if service.entries.get(rid) is entry:
            del service.entries[rid]

    w.callbacks.append(publish)
    service.metrics.observe_finish(req, reason, now)


def refresh_gauges(service) -> None:
    waiting, running, swapped = len(service.pending), 0, 0
    for loop in service.loops.values():
        sched = loop.sched
        if sched is None:
            continue
        waiting += sched.num_waiting
        running += sched.num_running
        swapped += sched.num_swapped
        service.metrics.kv_usage.labels(loop.address).set(sched.block_manager.device_utilization)
    m = service.metrics
    m.waiting.set(waiting)
    m.running.set(running)
    m.swapped.set(swapped)
