"""Helpers for tests and benchmarks that run the scheduler for real (not used in serving).

async with running_scheduler(redis_url, [executor_address], policy="fcfs") as handle:
    async with aio_channel(handle.address) as ch:
        events = await generate(SchedulerStub(ch), gen_request("r1", [1, 2, 3], 8))
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path

import grpc

from services.common.pb import common_pb2, scheduler_pb2
from services.common.settings import SchedulerSettings
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.policies import make_policy
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler


def gen_request(
    rid: str,
    prompt: list[int],
    max_tokens: int,
    *,
    seed: int | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    **fields,
) -> scheduler_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    return scheduler_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        ignore_eos=ignore_eos,
        **fields,
    )


async def generate(
    stub, request: scheduler_pb2.GenerateRequest, timeout: float = 60.0
) -> list[scheduler_pb2.TokenEvent]:
    """Every event of one Generate stream (raises grpc.aio.AioRpcError on a status)."""
    return [event async for event in stub.Generate(request, timeout=timeout)]


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if not e.finished]


async def status_of(stub, request) -> grpc.StatusCode:
    """The status a Generate call ends with (OK when it streams to the end)."""
    try:
        await generate(stub, request)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@contextlib.asynccontextmanager
async def running_scheduler(redis_url: str, executors: list[str], **settings):
    """An in-process scheduler service on a free loopback port."""
    from services.scheduler.server import start_scheduler

    handle = await start_scheduler(
        SchedulerSettings(redis_url=redis_url, executors=executors, scheduler_port=0, **settings)
    )
    try:
        yield handle
    finally:
        await handle.stop()


def core_request(
    pb: scheduler_pb2.GenerateRequest,
    eos_token_ids=(),
    now: float | None = None,
    max_model_len: int | None = None,
) -> Request:
    from services.scheduler.validation import ModelLimits, request_from_pb

    limits = ModelLimits(max_model_len=max_model_len, eos_token_ids=tuple(eos_token_ids))
    return request_from_pb(pb, pb.request_id, time.time() if now is None else now, limits)


def reference_run(
    engine, requests: list[Request], policy: str = "fcfs", knobs: dict | None = None
) -> dict[str, list[int]]:
    """Drive an in-process Engine with the core Scheduler directly (no service, no gRPC):
    the output tokens each request gets."""
    from services.common.pb import executor_pb2
    from services.scheduler.loop.executors import cost_model_for

    info = executor_pb2.ExecutorInfo(
        block_size=engine.block_size, num_device_blocks=engine.num_device_blocks
    )
    bm = BlockManager(engine.num_device_blocks, engine.num_host_blocks, engine.block_size)
    sched = Scheduler(
        make_policy(policy, **(knobs or {})), bm, cost_model_for(info), engine.max_model_len
    )
    for req in requests:
        sched.admit(req)
    while True:
        now = time.time()
        out = sched.schedule(now)
        if out.is_empty:
            break
        result = engine.step(out)
        sched.update(result.outcome(), now)
    return {r.request_id: list(r.output_token_ids) for r in requests}


async def start_tiny_executor(
    model_dir,
    num_device_blocks: int = 256,
    num_host_blocks: int = 64,
    block_size: int = 16,
    port: int = 0,
    registry_url: str | None = None,
    dtype: str = "fp32",
):
    """A real executor gRPC server on loopback serving the model in `model_dir` on CPU
    (registered in the executor registry at `registry_url` when given). fp32 by default:
    tests compare token streams across recomputes and failovers, which bf16 on a CPU (not
    batch-invariant) does not keep bit for bit."""
    import asyncio

    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine
    from services.executor.server import start_executor

    engine = await asyncio.to_thread(  # off the loop: other services may share it
        Engine,
        model_dir,
        device="cpu",
        dtype=dtype,
        block_size=block_size,
        num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks,
    )
    settings = ExecutorSettings(
        model=str(model_dir),
        executor_host="127.0.0.1",
        executor_port=port,
        device="cpu",
        dtype="fp32",
        block_size=block_size,
        registry_url=registry_url,
    )
    return await start_executor(settings, engine=engine)


def cached_tiny_model(arch: str = "llama", seed: int = 0) -> Path:
    """`make_tiny_model` once per machine: kept under the temp dir, keyed by the generator's
    source hash (a changed generator writes a new model); written atomically."""
    import lab.executor.tiny as tiny

    digest = hashlib.sha256(Path(tiny.__file__).read_bytes()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"alise-tiny-{arch}-{seed}-{digest}-{os.getuid()}"
    if (path / "config.json").exists():
        return path
    staging = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    tiny.make_tiny_model(staging / "model", arch, seed=seed)
    with contextlib.suppress(OSError):  # another process won the race: use its copy
        os.rename(staging / "model", path)
    shutil.rmtree(staging, ignore_errors=True)
    return path


# Containers that are bounded by design, not by the requests served: KV block pools and the
# prefix cache's registry (bounded by the number of blocks), one entry per level or executor
# or subscription, fixed-length windows, and heaps whose stale entries leave when they fall due
# (bounded by time: the aging threshold, a TTFT objective); configuration (the static executor
# list, the leader lease's keys).
BOUNDED = frozenset(
    {
        "_free_dev",
        "_free_host",
        "free",
        "ref",
        "by_hash",
        "hash_of",
        "lru",
        "level_rem",
        "recent",
        "_heap",
        "ttft_heap",
        "loops",
        "open",
        "_work",
        "knobs",
        "static",
        "keys",
    }
)


def retained(root: object, name: str, allow: frozenset[str] = BOUNDED) -> dict[str, int]:
    """Every non-empty dict, set, list or deque reachable from `root` through the attributes
    of the scheduler's own objects (services.scheduler.*), except the `allow`ed attribute
    names: after every request has finished, per-request state that was never dropped."""
    found: dict[str, int] = {}
    _walk(root, name, allow, set(), found, 0)
    return found


def _walk(
    obj: object, path: str, allow: frozenset[str], seen: set, found: dict, depth: int
) -> None:
    if id(obj) in seen or depth > 6 or not type(obj).__module__.startswith("services.scheduler"):
        return
    seen.add(id(obj))
    for key, value in getattr(obj, "__dict__", {}).items():
        where = f"{path}.{key}"
        if isinstance(value, (dict, set, list, deque)):
            items = list(value.values()) if isinstance(value, dict) else list(value)
            for i, item in enumerate(items):  # e.g. the executor loops, the level queues
                _walk(item, f"{where}[{i}]", allow, seen, found, depth + 1)
            nested = [len(v) for v in items if isinstance(v, dict)]
            size = sum(nested) if nested and len(nested) == len(items) else len(value)
            if size and key not in allow:
                found[where] = size
        else:
            _walk(value, where, allow, seen, found, depth + 1)
