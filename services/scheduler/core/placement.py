"""Placement across executors: the one with the least predicted outstanding work that can
hold the request at all (its known tokens plus one fit the executor's limits)."""
from __future__ import annotations


def can_hold(sched, req) -> bool:
    """What `Scheduler.add_request` requires of the length: the known tokens (prompt, plus
    output of a re-admitted request) and one more fit, and max_tokens is not reached yet."""
    limit = sched.max_model_len if req.max_model_len is None else min(req.max_model_len,
                                                                      sched.max_model_len)
    return req.num_tokens + 1 <= limit and req.num_output_tokens < req.max_tokens


def choose_executor(schedulers: dict, req, now: float) -> str | None:
    """Name of the scheduler to add `req` to, or None when no executor can hold it.
    Ties go to the name that sorts first (deterministic)."""
    best, best_work = None, None
    for name in sorted(schedulers):
        sched = schedulers[name]
        if not can_hold(sched, req):
            continue
        work = sched.outstanding_work(now)
        if best_work is None or work < best_work:
            best, best_work = name, work
    return best
