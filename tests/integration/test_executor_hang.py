"""An executor that hangs (SIGSTOP) rather than dies, over HTTP through a real gateway: its Step
outlives the hang deadline (a multiple of the predicted step time, with a floor), the executor
is marked down like a crash and its requests finish on the other executor with the text of an
undisturbed run; once it resumes (SIGCONT) it is polled back."""

from __future__ import annotations

import asyncio
import signal
import time

from services.common.grpc_client import sync_channel
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from tests.integration.test_gateway_reattach import assert_intact, run_all

FLOOR_S = 2.0


def executor_stats(stack) -> dict[str, scheduler_pb2.ExecutorStats]:
    with sync_channel(stack.scheduler_address) as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).Stats(
            scheduler_pb2.StatsRequest(), timeout=5
        )
    return {e.address: e for e in reply.executors}


def test_a_stopped_executor_is_marked_down_and_its_requests_finish_elsewhere(stack_factory):
    stack = stack_factory(
        num_executors=2,
        env={"ALISE_STEP_TIMEOUT_FLOOR_S": str(FLOOR_S), "ALISE_HEALTH_POLL_S": "0.2"},
    )
    n = 8
    reference = asyncio.run(run_all(stack.url, stack.model_id, n))
    stopped: list[str] = []

    def stop_a_busy_executor() -> None:
        busy = [a for a, e in executor_stats(stack).items() if e.running]
        assert busy, "no executor has work: nothing to test"
        name = f"executor-{stack.executor_addresses.index(busy[0])}"
        stopped.append(name)
        stack.signal(name, signal.SIGSTOP)

    started = time.monotonic()
    try:
        clients = asyncio.run(run_all(stack.url, stack.model_id, n, stop_a_busy_executor))
        elapsed = time.monotonic() - started
        states = {a: e.up for a, e in executor_stats(stack).items()}
    finally:
        for name in stopped:
            stack.signal(name, signal.SIGCONT)
    assert_intact(clients, reference)
    address = stack.executor_addresses[int(stopped[0].rsplit("-", 1)[1])]
    assert states[address] is False  # detected as hung, not waited on
    assert elapsed < 60  # far below the 60 s hard Step timeout plus the work
    deadline = time.monotonic() + 20
    while not executor_stats(stack)[address].up:  # resumed: polled back
        assert time.monotonic() < deadline, "the resumed executor was not brought back"
        time.sleep(0.2)
