"""`alise bench iteration`: the scheduler's own work per iteration, in-process, no I/O.

One steady-state decode iteration of N running requests on one executor, as the live loop
does it, each part timed: the core's `schedule` (fcfs), encoding the StepRequest, the stub
executor's Step (not counted), decoding the StepResult and the core's `update`, the recorder
(the iteration's Redis write, token events, metrics), the Redis commit's arguments (the Lua
script's JSON and token blob, packed as redis-py sends them, not sent), publishing the token
events to the requests' streams, and delivering them: every request attached to one gateway
subscription, the step's events as one EventBatch, serialized (services/scheduler/
subscriptions.py). What is left of the scheduler's CPU per iteration in the fleet benchmark
is I/O: gRPC to the executor and to the gateway, and the Redis round trip.
"""

from __future__ import annotations

import argparse
import statistics
import time

from redis.asyncio import Connection

_PACKER = Connection()  # never connects: packs a command as the store's client does

PARTS = ("schedule", "encode", "decode_update", "record", "commit_args", "publish", "deliver")


class _Writer:
    """Collects the writes the recorder submits (the store writer's interface)."""

    def __init__(self) -> None:
        self.writes: list = []

    def submit(self, write) -> None:
        self.writes.append(write)


def _setup(requests: int):
    from lab.executor.stub import StubEngine
    from services.common.settings import SchedulerSettings
    from services.executor.servicer import info_to_pb
    from services.scheduler.admission import Admission
    from services.scheduler.core.request import Request
    from services.scheduler.entry import Entry
    from services.scheduler.loop.executors import make_scheduler
    from services.scheduler.loop.recorder import StepRecorder
    from services.scheduler.metrics import SchedulerMetrics
    from services.scheduler.store.streams import RequestStream
    from services.scheduler.subscriptions import Subscription

    engine = StubEngine(0.0)
    sched = make_scheduler("fcfs", {}, info_to_pb(engine.describe()))
    metrics = SchedulerMetrics("stub")
    admission = Admission(SchedulerSettings(executors=[]), metrics, dict, lambda _: None)
    entries: dict = {}
    recorder = StepRecorder(entries, admission, metrics, _Writer())  # type: ignore[arg-type]
    for i in range(requests):
        req = Request(f"r{i}", [5 + i % 900] * 16, 1_000_000, 0.0, ignore_eos=True)
        entries[req.request_id] = Entry(req, RequestStream(req.request_id), executor="x")
        sched.admit(req)
    subscription = Subscription("bench")
    for entry in entries.values():
        subscription.attach(entry.stream, 0)
    return engine, sched, recorder, subscription


def _iteration(engine, sched, recorder, subscription) -> list[float]:
    """One iteration; the seconds of each part of PARTS."""
    from services.executor.servicer import result_to_pb, step_from_pb
    from services.scheduler.convert import step_outcome, step_request
    from services.scheduler.store.script import script_args

    t0 = time.perf_counter()
    out = sched.schedule(time.time())
    preempted = sched.last_shape.preempted_request_ids
    t1 = time.perf_counter()
    pb = step_request(out)
    t2 = time.perf_counter()
    result = result_to_pb(engine.step(step_from_pb(pb)))
    t3 = time.perf_counter()
    updates = sched.update(step_outcome(result), time.time())
    t4 = time.perf_counter()
    write = recorder.record("x", out, preempted, updates, {})
    t5 = time.perf_counter()
    _PACKER.pack_command("EVALSHA", "0" * 40, 0, *script_args("alise", 300_000, [write], 1))
    t6 = time.perf_counter()
    for callback in write.callbacks:
        callback()
    t7 = time.perf_counter()
    batch = subscription.take()
    if batch is not None:
        batch.SerializeToString()
    t8 = time.perf_counter()
    return [t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t8 - t7]


def measure(requests: int, iterations: int, warmup: int = 50) -> dict:
    parts_of = _setup(requests)
    samples: list[list[float]] = [[] for _ in PARTS]
    for i in range(warmup + iterations):
        parts = _iteration(*parts_of)
        if i >= warmup:
            for column, seconds in zip(samples, parts, strict=True):
                column.append(seconds * 1e6)
    medians = {name: round(statistics.median(col), 1) for name, col in zip(PARTS, samples)}
    return {
        "requests": requests,
        "iterations": iterations,
        "median_us": medians,
        "total_median_us": round(sum(medians.values()), 1),
    }


def _run(args: argparse.Namespace) -> int:
    import os

    from lab.workload.report import emit_json

    runs = [measure(args.requests, args.iterations) for _ in range(args.repeats)]
    totals = sorted(r["total_median_us"] for r in runs)
    result = {
        "runs": runs,
        "total_us_median_of_runs": totals[len(totals) // 2],
        "total_us_range": [totals[0], totals[-1]],
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    emit_json(result, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "iteration", help="the scheduler's in-process work per decode iteration (no I/O)"
    )
    p.add_argument("--requests", type=int, default=64, help="running (decoding) requests")
    p.add_argument("--iterations", type=int, default=400, help="timed iterations per run")
    p.add_argument("--repeats", type=int, default=3, help="runs (medians reported per run)")
    p.add_argument("--json", help="also write the figures to this file")
    p.set_defaults(func=_run)
