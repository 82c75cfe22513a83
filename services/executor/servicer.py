"""gRPC Executor servicer: protobuf <-> engine messages, engine work off the event loop."""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import grpc

from services.common import sampling_pb
from services.common.grpc_server import ServiceError
from services.common.pb import executor_pb2, executor_pb2_grpc
from services.common.step import NewRequestData, SchedulerOutput
from services.executor.messages import StepOutput

if TYPE_CHECKING:
    from services.executor.engine import Engine
    from services.executor.metrics import ExecutorMetrics
    from services.executor.warmup import Startup


T = TypeVar("T")


def _unique(ids: list[str], what: str) -> None:
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} lists a request twice")


def step_from_pb(req: executor_pb2.StepRequest) -> SchedulerOutput:
    _unique([t.request_id for t in req.block_tables], "block_tables")
    _unique([s.request_id for s in req.scheduled], "scheduled")
    return SchedulerOutput(
        step_id=req.step_id,
        new_requests=[
            NewRequestData(
                r.request_id,
                list(r.token_ids),
                sampling_pb.from_pb(r.sampling),
                r.num_output_tokens,
                r.num_cached_tokens,
                r.max_tokens,
            )
            for r in req.new_requests
        ],
        block_tables={t.request_id: (list(t.block_ids), t.replace) for t in req.block_tables},
        num_scheduled_tokens={s.request_id: s.num_new_tokens for s in req.scheduled},
        swap_out=[(m.src, m.dst) for m in req.swap_out],
        swap_in=[(m.src, m.dst) for m in req.swap_in],
        free_request_ids=list(req.free_request_ids),
    )


def result_to_pb(out: StepOutput) -> executor_pb2.StepResult:
    t = out.timings
    pb = executor_pb2.StepResult(
        step_id=out.step_id,
        timings=executor_pb2.StepTimings(
            forward_s=t.forward_s, sample_s=t.sample_s, swap_wait_s=t.swap_wait_s, total_s=t.total_s
        ),
        num_prefill_tokens=out.num_prefill_tokens,
        num_decode_tokens=out.num_decode_tokens,
    )
    add = pb.sampled.add  # 3x faster than appending messages built one by one
    for rid, (tok, lp) in out.sampled.items():
        add(request_id=rid, token_id=tok, logprob=lp)
    if out.top:
        for sampled in pb.sampled:
            for tid, value in out.top.get(sampled.request_id, ()):
                sampled.top.add(token_id=tid, logprob=value)
    add_forecast = pb.forecasts.add
    for rid, f in out.forecasts.items():
        add_forecast(
            request_id=rid, generated=f.generated, q10=f.q10, q50=f.q50, q90=f.q90, p_cap=f.p_cap
        )
    for rid, (start, entries) in out.prompt.items():
        rows = pb.prompt_logprobs.add(request_id=rid, start=start)
        for tid, value, top in entries:
            entry = rows.tokens.add(token_id=tid, logprob=value)
            for alt, alt_value in top:
                entry.top.add(token_id=alt, logprob=alt_value)
    return pb


async def _next(ahead: asyncio.Queue[T | None], reader: asyncio.Future) -> T | None:
    """The next Step read ahead; the reader's error (a broken stream) if it failed first."""
    if not ahead.empty():
        return ahead.get_nowait()
    getting = asyncio.ensure_future(ahead.get())
    try:
        await asyncio.wait({getting, reader}, return_when=asyncio.FIRST_COMPLETED)
        if not getting.done() and reader.exception() is not None:
            raise reader.exception()  # type: ignore[misc]
        return await getting  # a reader that ended normally queued None last
    finally:
        getting.cancel()


def info_to_pb(info: dict) -> executor_pb2.ExecutorInfo:
    fields = set(executor_pb2.ExecutorInfo.DESCRIPTOR.fields_by_name)
    return executor_pb2.ExecutorInfo(**{k: v for k, v in info.items() if k in fields})


class _Decoded:
    """A streamed Step read ahead, decoded while the one before it runs (a malformed one
    keeps its error for its turn)."""

    __slots__ = ("decode_s", "error", "request", "step")

    def __init__(self, request: executor_pb2.StepRequest) -> None:
        start = time.perf_counter()
        self.request = request
        self.step: SchedulerOutput | None = None
        self.error: Exception | None = None
        try:
            self.step = step_from_pb(request)
        except ValueError as exc:
            self.error = exc
        self.decode_s = time.perf_counter() - start


@dataclass
class _Ran:
    out: StepOutput
    start: float  # perf_counter when the Step's work began (its decoding counted)


class _Chain:
    """One stream's Steps: once one fails (or the stream ends), the ones queued behind it
    are skipped, not run on a state they did not expect."""

    __slots__ = ("broken",)

    def __init__(self) -> None:
        self.broken = False


class EngineLane:
    """The one thread that runs the engine's Steps, in the order they are handed over.

    A Step handed over while another runs starts the moment that one ends, in the same
    thread, with no trip through the event loop (the executor's gap between pipelined Steps);
    Steps from a unary call and a stream, or from an abandoned stream and its successor,
    never run side by side."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")

    def submit(self, work: Callable[[], T]) -> asyncio.Future[T]:
        ctx = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(self._pool, ctx.run, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(
        self,
        engine: Engine | None,
        metrics: ExecutorMetrics | None = None,
        startup: Startup | None = None,
    ) -> None:
        """engine None: still loading (`startup` says how far); every RPC is UNAVAILABLE
        until the start-up reaches `serving`."""
        self.engine = engine
        self.metrics = metrics
        self.startup = startup
        self._profiling = asyncio.Lock()
        self.lane = EngineLane()
        self.epoch = 0  # the highest scheduler leadership epoch seen in a Step (engine thread)

    def ready(self) -> Engine:
        """The engine, once start-up has finished; otherwise UNAVAILABLE."""
        if self.engine is None or (self.startup is not None and not self.startup.serving):
            phase = self.startup.phase.value if self.startup is not None else "loading"
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"the executor is {phase}")
        return self.engine

    async def Describe(
        self, request: executor_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorInfo:
        return info_to_pb(self.ready().describe())

    async def Step(
        self, request: executor_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.StepResult:
        return await self._step(request)

    async def StepStream(
        self,
        request_iterator: AsyncIterator[executor_pb2.StepRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Steps in order, one result each. Each Step is decoded and handed to the engine's
        lane as it arrives, so a Step the scheduler sent ahead (pipelined) starts the moment
        the one before it ends; the finished one's result is encoded and written while it
        runs (with nothing queued, the result goes out at once: the scheduler may be waiting
        for it to plan the next)."""
        ahead: asyncio.Queue[asyncio.Future[_Ran] | None] = asyncio.Queue()
        chain = _Chain()

        async def read_ahead() -> None:
            while (request := await context.read()) is not grpc.aio.EOF:
                ahead.put_nowait(self._launch(_Decoded(request), chain))
            ahead.put_nowait(None)

        reader = asyncio.ensure_future(read_ahead())
        sending: asyncio.Future | None = None
        finished: _Ran | None = None  # the last Step's output, its result not sent yet
        try:
            while True:
                if finished is not None and ahead.empty():
                    sending = await self._send(context, finished, sending)
                    finished = None
                if (running := await _next(ahead, reader)) is None:
                    break
                if finished is not None:  # the next Step already runs
                    sending = await self._send(context, finished, sending)
                    finished = None
                try:
                    # shielded: a cancelled stream leaves the running Step to end
                    finished = await asyncio.shield(running)
                except Exception:  # refused (stale epoch, malformed): the last result first
                    if sending is not None:
                        await sending
                    raise
            if finished is not None:
                sending = await self._send(context, finished, sending)
            if sending is not None:
                await sending
        finally:
            chain.broken = True
            while not ahead.empty():  # queued behind the running Step: never started
                if (queued := ahead.get_nowait()) is not None:
                    queued.cancel()
            for task in (reader, sending):
                if task is not None and not task.done():
                    task.cancel()

    def _launch(self, decoded: _Decoded, chain: _Chain) -> asyncio.Future[_Ran]:
        """Hand one Step to the engine's lane; it runs after those before it (unless an earlier
        Step of its `chain`, its stream, failed; a unary Step has a chain of its own)."""

        def run() -> _Ran:
            if chain.broken:
                raise ServiceError(grpc.StatusCode.ABORTED, "an earlier Step of the stream failed")
            start = time.perf_counter()
            try:
                engine = self.ready()
                if decoded.error is not None:
                    raise decoded.error
                assert decoded.step is not None  # decoded, or its error raised above
                self._fence(decoded.request.epoch, decoded.step)
                return _Ran(engine.step(decoded.step), start - decoded.decode_s)
            except BaseException:
                chain.broken = True
                raise

        return self.lane.submit(run)

    async def _send(
        self, context: grpc.aio.ServicerContext, ran: _Ran, sending: asyncio.Future | None
    ) -> asyncio.Future:
        """Encode a streamed Step's result and write it (after the previous write)."""
        pb = self._result(ran)
        if sending is not None:
            await sending
        return asyncio.ensure_future(context.write(pb))

    def _result(self, ran: _Ran) -> executor_pb2.StepResult:
        """A Step's StepResult. The executor's time is its whole step, decoding the request
        and encoding the reply included: what the scheduler measures around a Step minus this
        is transport and its own work."""
        out = ran.out
        pb = result_to_pb(out)
        out.timings.total_s = pb.timings.total_s = time.perf_counter() - ran.start
        if self.metrics is not None:
            self.metrics.observe(out)
        return pb

    async def _step(self, request: executor_pb2.StepRequest) -> executor_pb2.StepResult:
        self.ready()
        return self._result(await self._launch(_Decoded(request), _Chain()))

    def _fence(self, epoch: int, step: SchedulerOutput) -> None:
        """Refuse a deposed scheduler's Step; on a new leader's first, drop every request."""
        if epoch == 0:
            return
        if epoch < self.epoch:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale scheduler: epoch {epoch} < {self.epoch} (another scheduler leads now)",
            )
        if epoch > self.epoch:
            if self.epoch:
                step.free_request_ids = list(
                    dict.fromkeys([*self.ready().requests, *step.free_request_ids])
                )
            self.epoch = epoch

    async def Profile(
        self, request: executor_pb2.ProfileRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ProfileResult:
        engine = self.ready()
        if self._profiling.locked():
            raise ValueError("a profile is already running")
        async with self._profiling:
            profile = await self.lane.submit(partial(engine.profile, request.quick))
        engine.save_profile(profile)
        return executor_pb2.ProfileResult(profile_json=json.dumps(profile))
