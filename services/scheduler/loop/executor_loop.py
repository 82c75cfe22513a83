"""One loop per executor: pipelined `schedule -> Step -> update`, plus health polling while
it is down.

Steps are pipelined: while the executor runs step n the loop has already planned and sent
step n+1 (the core counts step n's sampled tokens as pending, see core/scheduler.py), so the
executor starts it the moment step n ends and never waits on the scheduler's work. When step
n's result arrives the loop applies it, plans and sends step n+2, then records step n (its Redis
write, handed to the store writer; token events follow the commit), all while step n+1 runs.
The loop awaits only its executor. A failed or timed-out Step marks the executor down (any Step
queued behind it is dropped with it); its host then recomputes its requests elsewhere. The loop
knows its host only through the `LoopHost` protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from services.common.pb import executor_pb2
from services.common.tasks import cancel_and_wait
from services.scheduler.convert import step_outcome, step_request
from services.scheduler.loop.executor_client import ExecutorClient

if TYPE_CHECKING:
    from services.common.pb.executor_pb2 import StepResult
    from services.common.step import RequestUpdate, SchedulerOutput
    from services.scheduler.core.scheduler import Scheduler
    from services.scheduler.core.shape import StepShape

log = logging.getLogger(__name__)


@dataclass
class CompletedStep:
    """One Step as the loop saw it: what was sent, what came back, what the core made of it."""

    out: SchedulerOutput
    shape: StepShape  # what the core knew of it besides what it sent
    updates: list[RequestUpdate]
    result: StepResult
    sent_at: float  # wall-clock time the Step went out
    estimate_s: float  # the cost model's estimate of its time
    round_trip_s: float  # send to result


class LoopHost(Protocol):
    """What an executor loop tells the service, and the one thing it asks of it."""

    def make_scheduler(self, info: executor_pb2.ExecutorInfo) -> Scheduler:
        """A fresh core scheduler for an executor that (re)connected."""
        ...

    def executor_up(self, loop: ExecutorLoop) -> None: ...

    def executor_down(self, loop: ExecutorLoop, sched: Scheduler | None, reason: str) -> None:
        """`sched` held the executor's requests: re-admit them elsewhere."""
        ...

    def step_done(self, loop: ExecutorLoop, step: CompletedStep) -> None:
        """Record a completed Step (called while the next one is in flight)."""
        ...

    def stale_freed(self, loop: ExecutorLoop, ids: list[str]) -> None: ...

    def step_overhead(self, seconds: float) -> None:
        """Time between two Steps not spent in the executor (a metric)."""
        ...


@dataclass
class Flight:
    """A Step sent to the executor whose result the loop has not read yet."""

    out: SchedulerOutput
    shape: StepShape
    call: asyncio.Task
    planned_at: float  # wall-clock time the plan started
    t_start: float  # perf_counter: plan started
    t_send: float  # perf_counter: sent
    estimate_s: float  # the cost model's estimate of its time
    computes: bool = field(default=True)  # it computes or moves KV (not a free-only Step)


@dataclass(frozen=True)
class LoopTiming:
    step_timeout_s: float = 30.0  # hard cap on one Step
    # A Step slower than `factor` x its predicted time (but never under the floor) means the
    # executor hangs (e.g. SIGSTOPped, a stuck device): it is marked down like a crash.
    step_timeout_factor: float = 10.0
    step_timeout_floor_s: float = 5.0
    step_spin_ms: float = 0.0  # hybrid polling window before a Step's expected end (0: off)
    pipeline_depth: int = 2  # Steps in flight at once (1: plan each Step after the last ends)
    poll_interval_s: float = 0.5  # reconnect attempts while down
    health_interval_s: float = 2.0  # health checks while idle
    max_backoff_s: float = 5.0


class ExecutorLoop:
    def __init__(
        self, address: str, host: LoopHost, timing: LoopTiming, stale: Iterable[str] = ()
    ) -> None:
        self.address = address
        self.host = host
        self.timing = timing
        self.client = ExecutorClient(address)
        self.sched: Scheduler | None = None  # core scheduler while up, None while down
        self.info: executor_pb2.ExecutorInfo | None = None
        self.up = False
        self.down_since: float | None = time.time()
        self.stale: set[str] = set(stale)  # ids the executor may hold: freed in the next Step
        # Per Step, when set to a deque (the overhead benchmark does; a server keeps none, the
        # metric has the overheads): (seconds between two Steps minus the first Step's
        # executor time, requests in that first Step, seconds of it spent in this loop's own
        # code: update, Redis hand-off, schedule, encoding)
        self.overheads: deque[tuple[float, int, float]] | None = None
        self.steps = 0
        self.sent_ahead = 0  # Steps sent while another was in flight (pipelined)
        self.failures = 0  # consecutive failed attempts (reconnect backoff)
        self._wake = asyncio.Event()
        self._flights: deque[Flight] = deque()  # Steps sent, oldest first
        self._last_recv: float | None = None  # perf_counter: the last result arrived
        self._compute = 0.0  # seconds of loop code since the last result arrived
        self._model_ratio = 1.0  # measured / cost-model step time, smoothed
        self._deferred: CompletedStep | None = None  # the last Step, not yet recorded
        self._task: asyncio.Task | None = None
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"loop-{self.address}")

    async def stop(self) -> None:
        # A cancel can be swallowed (see services/common/tasks.py): the loop checks a flag too.
        self._closing = True
        await cancel_and_wait(self._task)
        self._task = None
        self._drop_flights()
        await self.client.close()

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while not self._closing:
            try:
                if not self.up:
                    await self._connect()
                else:
                    await self._iterate()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("executor loop iteration failed", extra={"executor": self.address})
                self._deferred = None
                self._down("internal error in the loop")
        self._drop_flights()

    # -- connecting and health ---------------------------------------------------------------
    async def _connect(self) -> None:
        if self.failures:  # back off from an executor that keeps failing
            await self._sleep(min(self.timing.max_backoff_s, 0.05 * 2**self.failures))
        try:
            info = await self.client.describe(timeout=2.0)
        except (grpc.aio.AioRpcError, TimeoutError):
            await self._sleep(self.timing.poll_interval_s)
            return
        if self.info is not None and info.instance_id != self.info.instance_id:
            log.warning("executor restarted: its KV is lost", extra={"executor": self.address})
        if not await self._free_stale():
            return
        self.info = info
        self.sched = self.host.make_scheduler(info)
        self.sched.pipeline_depth = self.timing.pipeline_depth
        self.up, self.down_since, self._last_recv = True, None, None
        self.failures = 0
        log.info(
            "executor up",
            extra={
                "executor": self.address,
                "instance": info.instance_id,
                "blocks": info.num_device_blocks,
            },
        )
        self.host.executor_up(self)

    async def _free_stale(self) -> bool:
        """Before anything is sent again, a free-only Step drops every request the executor may
        still hold from before (a restart of this service, or a failed Step)."""
        if not self.stale:
            return True
        stale = sorted(self.stale)
        try:
            await self.client.step(
                executor_pb2.StepRequest(free_request_ids=stale), timeout=self.timing.step_timeout_s
            )
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            self.failures += 1
            log.warning(
                "freeing stale requests failed",
                extra={"executor": self.address, "error": _brief(exc)},
            )
            return False
        self.stale.difference_update(stale)
        self.host.stale_freed(self, stale)
        return True

    async def _health_check(self) -> None:
        """While idle: notice a restarted executor (new instance id) or a dead one."""
        try:
            info = await self.client.describe(timeout=2.0)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            self._down(f"health check failed: {_brief(exc)}")
            return
        if info.instance_id != self.info.instance_id:
            self._down("executor restarted (new instance id): KV lost")

    def _down(self, reason: str) -> None:
        if not self.up:
            return
        log.warning("executor down", extra={"executor": self.address, "reason": reason})
        self._drop_flights()
        self._flush_record()
        self.up, self.down_since, self._last_recv = False, time.time(), None
        sched, self.sched = self.sched, None
        self.host.executor_down(self, sched, reason)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep until woken or `seconds` pass; True when woken."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
            woken = True
        except TimeoutError:
            woken = False
        self._wake.clear()
        return woken

    # -- one iteration -----------------------------------------------------------------------
    async def _iterate(self) -> None:
        """Keep the executor's queue full (up to `pipeline_depth` Steps, planned ahead only
        behind a computing Step), record the last result, then read the next one."""
        flights, sent = self._flights, False
        while len(flights) < self.timing.pipeline_depth and (not flights or flights[-1].computes):
            if not self._send_next():
                break
            sent = True
        if sent:
            await asyncio.sleep(0)  # the Step goes out before the last result is recorded
        self._flush_record()  # the previous result's write and events
        if not flights:
            self._last_recv = None
            if not await self._sleep(self.timing.health_interval_s):
                await self._health_check()
            return
        await self._receive()

    def _send_next(self) -> bool:
        """Plan the next Step and send it; False when there is nothing to send."""
        t_start = time.perf_counter()
        now = time.time()
        out = self.sched.schedule(now)
        computes = bool(out.num_scheduled_tokens or out.swap_out or out.swap_in)
        if not (computes or out.free_request_ids or out.new_requests):
            self._compute += time.perf_counter() - t_start
            return False
        pb = step_request(out)
        shape = self.sched.last_shape
        estimate = self.sched.cost_model.step_time(shape)
        # it waits for the Steps ahead of it: its deadline covers theirs too
        ahead = sum(f.estimate_s for f in self._flights)
        call = self.client.start_step(pb, timeout=self.step_deadline(ahead + estimate))
        t_send = time.perf_counter()
        self.sent_ahead += bool(self._flights)
        self._flights.append(Flight(out, shape, call, now, t_start, t_send, estimate, computes))
        self._compute += t_send - t_start
        return True

    async def _receive(self) -> None:
        """Read the oldest Step's result and apply it to the core."""
        flight = self._flights[0]
        try:
            started = max(flight.t_send, self._last_recv or 0.0)
            await self._wait_hot(flight.call, started + flight.estimate_s * self._model_ratio)
            result = await flight.call
        except asyncio.CancelledError:
            raise  # stopping: the Steps in flight go with the loop
        except (grpc.aio.AioRpcError, TimeoutError, ConnectionError) as exc:
            self.failures += 1
            self._down(f"Step failed: {_brief(exc)}")
            return
        self._flights.popleft()
        t_recv = time.perf_counter()
        exec_s = result.timings.total_s
        if flight.estimate_s > 0 and exec_s > 0:  # how far off the cost model runs
            self._model_ratio += 0.2 * (exec_s / flight.estimate_s - self._model_ratio)
        if self._last_recv is not None and flight.computes:
            # the executor's idle time before this Step: the time since the last result
            # minus this Step's own, when it was sent before the last result came back
            ran_from = max(self._last_recv, flight.t_send)
            overhead = max(0.0, t_recv - ran_from - exec_s)
            if self.overheads is not None:
                self.overheads.append(
                    (overhead, len(flight.out.num_scheduled_tokens), self._compute)
                )
            self.host.step_overhead(overhead)
        self._compute = 0.0
        self._last_recv = t_recv
        self.steps += flight.computes
        updates = self.sched.update(step_outcome(result), time.time())
        sent_at = flight.planned_at + (flight.t_send - flight.t_start)
        self._deferred = CompletedStep(
            flight.out,
            flight.shape,
            updates,
            result,
            sent_at,
            flight.estimate_s,
            t_recv - flight.t_send,
        )
        self._compute += time.perf_counter() - t_recv

    def _drop_flights(self) -> None:
        """Cancel every Step still in flight (the executor is down, or the loop stops)."""
        while self._flights:
            call = self._flights.popleft().call
            call.cancel()
            call.add_done_callback(_retrieve)  # one that failed first: its error is known

    def step_deadline(self, estimate_s: float) -> float:
        """How long a Step predicted to take `estimate_s` (by the cost model, corrected by how
        far off it has run on this executor) may take before the executor counts as hung."""
        t = self.timing
        expected = estimate_s * self._model_ratio
        return min(t.step_timeout_s, max(t.step_timeout_floor_s, t.step_timeout_factor * expected))

    async def _wait_hot(self, call: asyncio.Future, expected_end: float) -> None:
        """Hybrid polling: sleep until `step_spin_ms` before the Step should end, then keep the
        event loop awake (yielding to every other task) until it does, for at most three
        windows. An idle process takes 0.3-0.5 ms longer to pick up the result on the 2-core
        development machine; this spends at most three windows of one core per Step on it."""
        window = self.timing.step_spin_ms / 1000
        if window <= 0:
            return
        start = expected_end - window
        delay = start - time.perf_counter()
        if delay > 0:
            await asyncio.wait({call}, timeout=delay)
        give_up = max(start, time.perf_counter()) + 3 * window
        while not call.done() and time.perf_counter() < give_up:
            await asyncio.sleep(0)

    def _flush_record(self) -> None:
        """Record the last completed Step (Redis write, token events, metrics)."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self.host.step_done(self, deferred)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _brief(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
