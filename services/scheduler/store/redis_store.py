"""Redis store: the scheduler's durable state, written once per iteration, never awaited by a loop.

Layout under a namespace `ns` (default `alise`):

    {ns}:req:{id}       hash    request record (params JSON, status, executor, timestamps,
                                prediction, n_out, ...)
    {ns}:out:{id}       string  output tokens, 16 bytes each (<i token, f logprob, d time);
                                written with SETRANGE at index*16, so a retried write is harmless
    {ns}:q:{queue}      zset    the policy's queues (waiting | running | swapped), score = arrival
    {ns}:exec:{addr}    hash    per-executor KV budget (device/host blocks total and free),
                                instance_id, up
    {ns}:held:{addr}    set     request ids the executor may still hold state for
    {ns}:stats          hash    counters (finished, aborted, preemptions)

Loops describe what changed in an `IterationWrite`; the `StoreWriter` task commits every write
submitted since its last flush in one atomic Lua script call (store_script.py), then runs the
writes' callbacks (which publish token events). So a client never sees a token that Redis does
not hold, and a crash leaves Redis at an iteration boundary. `IterationWrite` and the value
formats live in iteration_write.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from services.common.redis_runner import async_client
from services.common.tasks import cancel_and_wait
from services.scheduler.store.iteration_write import QUEUES, TOKEN, FieldValue, IterationWrite
from services.scheduler.store.script import CREATE, LUA, script_args

log = logging.getLogger(__name__)

RUN_ID_CHECK_S = 0.5


class Keys:
    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    def req(self, rid: str) -> str:
        return f"{self.ns}:req:{rid}"

    def out(self, rid: str) -> str:
        return f"{self.ns}:out:{rid}"

    def queue(self, name: str) -> str:
        return f"{self.ns}:q:{name}"

    def executor(self, addr: str) -> str:
        return f"{self.ns}:exec:{addr}"

    def held(self, addr: str) -> str:
        return f"{self.ns}:held:{addr}"

    @property
    def stats(self) -> str:
        return f"{self.ns}:stats"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def decode_tokens(blob: bytes | None) -> list[tuple[int, float, float]]:
    if not blob:
        return []
    usable = len(blob) - len(blob) % TOKEN.size
    return [TOKEN.unpack_from(blob, off) for off in range(0, usable, TOKEN.size)]


class Fenced(Exception):
    """A write was refused: another scheduler holds a newer leadership epoch (lease.py)."""


class Store:
    """Async Redis access: reads, one-off writes, and the pipelined iteration commit.

    `epoch` is this scheduler's leadership epoch (0 = unfenced); commits carry it and Redis
    refuses them once another scheduler has taken over (store_script.py)."""

    def __init__(self, url: str, namespace: str = "alise", retention_s: float = 300.0) -> None:
        # Finite timeouts: a Redis that hangs (paused, partitioned) fails calls instead of
        # blocking them forever; the writer retries, admission refuses meanwhile.
        self.client = async_client(url)
        self.keys = Keys(namespace)
        self.retention_s = retention_s
        self.epoch = 0
        self._script = None
        self._create = None

    async def close(self) -> None:
        await self.client.aclose()

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    async def run_id(self) -> str:
        """The Redis server's run id: it changes when the server restarts."""
        info = await self.client.info("server")
        return str(info.get("run_id", ""))

    async def create(self, rid: str, record: dict[str, FieldValue], score: float) -> None:
        """Write a new request record and enqueue it as waiting (awaited by Generate only)."""
        if self._create is None:
            self._create = self.client.register_script(CREATE)
        fields = [x for name, value in record.items() for x in (name, value)]
        done = await self._create(args=[self.keys.ns, rid, score, self.epoch, *fields])
        if done == -1:
            raise Fenced(f"epoch {self.epoch} is no longer the leader's")

    async def exists(self, rid: str) -> bool:
        return bool(await self.client.exists(self.keys.req(rid)))

    async def load(self, rid: str) -> tuple[dict[str, str], list[tuple[int, float, float]]] | None:
        """A request's record and output tokens, or None when it is unknown or expired."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.keys.req(rid))
            pipe.get(self.keys.out(rid))
            raw, blob = await pipe.execute()
        if not raw:
            return None
        record = {_text(k): _text(v) for k, v in raw.items()}
        n_out = int(record.get("n_out", 0))
        return record, decode_tokens(blob)[:n_out]

    async def active_ids(self) -> list[str]:
        """Every request in some queue (not finished), oldest first."""
        scored: dict[str, float] = {}
        for name in QUEUES:
            for member, score in await self.client.zrange(
                self.keys.queue(name), 0, -1, withscores=True
            ):
                scored[_text(member)] = score
        return sorted(scored, key=lambda rid: (scored[rid], rid))

    async def queue_members(self, name: str) -> list[str]:
        return [_text(m) for m in await self.client.zrange(self.keys.queue(name), 0, -1)]

    async def drop_from_queues(self, rid: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            for name in QUEUES:
                pipe.zrem(self.keys.queue(name), rid)
            await pipe.execute()

    async def executor(self, addr: str) -> dict[str, str]:
        raw = await self.client.hgetall(self.keys.executor(addr))
        return {_text(k): _text(v) for k, v in raw.items()}

    async def held(self, addr: str) -> set[str]:
        return {_text(m) for m in await self.client.smembers(self.keys.held(addr))}

    async def stats(self) -> dict[str, int]:
        raw = await self.client.hgetall(self.keys.stats)
        return {_text(k): int(v) for k, v in raw.items()}

    async def commit(self, writes: list[IterationWrite]) -> None:
        """Apply several iteration writes, in order, atomically (one Lua script call)."""
        if self._script is None:
            self._script = self.client.register_script(LUA)
        ttl_ms = max(1, int(self.retention_s * 1000))
        done = await self._script(args=script_args(self.keys.ns, ttl_ms, writes, self.epoch))
        if done == -1:
            raise Fenced(f"epoch {self.epoch} is no longer the leader's")


class StoreWriter:
    """Background task that commits submitted writes; loops only call `submit` (no await).

    Writes submitted while a commit is in flight go together into the next commit. A failed
    commit is retried (every command in it is idempotent) with backoff until Redis answers;
    `healthy` is False from a failed commit until one succeeds (admission refuses meanwhile).
    When Redis answers again with another run id (it restarted and may have lost the last
    second of writes), `resync()`'s full state is committed first, in the same script call.
    A `Fenced` commit (another scheduler leads) is dropped with everything pending, and
    `on_fenced` is called.
    """

    def __init__(self, store: Store, max_backoff_s: float = 1.0) -> None:
        self.store = store
        self.max_backoff_s = max_backoff_s
        self._pending: list[IterationWrite] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self.commits = 0
        self.errors = 0
        self.resyncs = 0
        self.healthy = True
        self.fenced = False
        self.run_id = ""
        self.on_fenced: Callable[[], None] | None = None
        self.resync: Callable[[], IterationWrite] | None = None
        self._run_id_checked = time.monotonic()

    async def start(self) -> None:
        try:
            self.run_id = await self.store.run_id()
        except (RedisError, OSError):
            self.healthy = False
        self._task = asyncio.create_task(self._run(), name="store-writer")

    def submit(self, write: IterationWrite) -> None:
        if write.empty or self.fenced:
            return
        self._pending.append(write)
        self._idle.clear()
        self._wake.set()

    async def flush(self) -> None:
        """Wait until everything submitted so far is committed."""
        await self._idle.wait()

    async def close(self) -> None:
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self.flush(), timeout=5.0)
        except TimeoutError:
            log.error(
                "store writer could not flush before closing", extra={"pending": len(self._pending)}
            )
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if batch:
                await self._commit(batch)
            if not self._pending:
                self._idle.set()

    async def _commit(self, batch: list[IterationWrite]) -> None:
        backoff = 0.01
        while True:
            try:
                await self.store.commit(await self._with_resync(batch))
                break
            except Fenced as exc:
                self.fence(str(exc))
                return
            except (RedisError, OSError) as exc:
                self.errors += 1
                if self.healthy:
                    log.warning("redis unreachable: commits paused", extra={"error": str(exc)})
                self.healthy = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        if not self.healthy:
            log.warning("redis reachable again: commits caught up", extra={"writes": len(batch)})
        self.healthy = True
        self.commits += 1
        for write in batch:
            for callback in write.callbacks:
                try:
                    callback()
                except Exception:  # one bad callback must not stop the writer
                    log.exception("store writer callback failed")

    async def _with_resync(self, batch: list[IterationWrite]) -> list[IterationWrite]:
        """After a failure, and every RUN_ID_CHECK_S (the client reconnects by itself, so a
        restart need not fail a commit), check whether Redis restarted; if so, the full state
        goes first, in the same script call."""
        if self.healthy and time.monotonic() - self._run_id_checked < RUN_ID_CHECK_S:
            return batch
        run_id = await self.store.run_id()
        self._run_id_checked = time.monotonic()
        if run_id == self.run_id or self.resync is None:
            self.run_id = run_id
            return batch
        log.warning(
            "redis restarted: rewriting the full state", extra={"old": self.run_id, "new": run_id}
        )
        self.run_id = run_id
        self.resyncs += 1
        return [self.resync(), *batch]

    def fence(self, reason: str) -> None:
        """Another scheduler leads: drop everything pending and tell `on_fenced`."""
        log.warning("commit refused: another scheduler leads", extra={"reason": reason})
        self.fenced = True
        self._pending.clear()
        if self.on_fenced is not None:
            self.on_fenced()
