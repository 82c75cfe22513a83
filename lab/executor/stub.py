"""A stepping stub of the executor for scheduler benchmarks: the real gRPC service and Step
contract (the engine's own bookkeeping, `StepBook`: every Step is checked and applied as the
engine does), no model and no torch.

Each Step waits `step_s` (off the event loop, as the engine's forward pass does) and "samples"
a deterministic token for every request whose scheduled tokens reach its end. Many stubs can
serve from one process (`serve_stubs`), so one machine can offer a scheduler dozens of
executors: `alise bench overhead --fake-executors N` measures how many one scheduler sustains.
It never produces text anyone reads; it is not a fallback for a missing model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.step import SchedulerOutput
from services.executor.messages import StepOutput, StepTimings
from services.executor.step_plan import StepBook

if TYPE_CHECKING:
    from services.executor.server import ExecutorHandle

STUB_VOCAB = 32_000
STUB_EOS = 2  # never sampled: lengths are max_tokens


class StubEngine:
    def __init__(
        self,
        step_s: float = 0.025,
        *,
        num_device_blocks: int = 4096,
        num_host_blocks: int = 1024,
        block_size: int = 16,
        max_model_len: int = 4096,
    ) -> None:
        self.step_s = step_s
        self.block_size = block_size
        self.num_device_blocks, self.num_host_blocks = num_device_blocks, num_host_blocks
        self.max_model_len = max_model_len
        self.instance_id = uuid.uuid4().hex
        self.book = StepBook(
            num_device_blocks, num_host_blocks, block_size, max_model_len, STUB_VOCAB
        )
        self.requests = self.book.requests
        self._lock = threading.Lock()
        self.marks: list[tuple[float, float]] = []  # (start, end) of each Step that ran tokens

    def describe(self) -> dict:
        profile = {
            "device": "stub",
            "model": "stub",
            "coefficients": {"c0": self.step_s, "c_prefill": 0, "c_decode": 0, "c_context": 0},
        }
        return {
            "model": "stub",
            "architecture": "stub",
            "dtype": "none",
            "kv_dtype": "none",
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "bytes_per_block": 0,
            "num_device_blocks": self.num_device_blocks,
            "num_host_blocks": self.num_host_blocks,
            "device": "stub",
            "vocab_size": STUB_VOCAB,
            "eos_token_ids": [STUB_EOS],
            "profile_json": json.dumps(profile),
            "instance_id": self.instance_id,
            "attention_backend": "none",
        }

    def step(self, step: SchedulerOutput) -> StepOutput:
        start = time.perf_counter()
        with self._lock:
            plan = self.book.plan(step)
            self.book.apply(plan)
            out = StepOutput(step.step_id, {}, StepTimings())
            for rid, n in plan.scheduled:
                st = self.requests[rid]
                st.num_computed += n
                done = st.num_computed == len(st.token_ids)
                if n == 1 and done:
                    out.num_decode_tokens += 1
                else:
                    out.num_prefill_tokens += n
                if done:
                    token = 3 + (len(st.token_ids) * 7919) % (STUB_VOCAB - 3)
                    st.token_ids.append(token)
                    st.num_output_tokens += 1
                    out.sampled[rid] = (token, 0.0)
        if plan.scheduled:
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - start)))
        end = time.perf_counter()
        if plan.scheduled:
            self.marks.append((start, end))
        out.timings.forward_s = out.timings.total_s = end - start
        return out

    def close(self) -> None:
        pass

    def profile(self, quick: bool = True) -> dict:
        return json.loads(self.describe()["profile_json"])

    def save_profile(self, profile: dict) -> None:
        pass


@dataclass
class StubFleet:
    handles: list[ExecutorHandle]

    @property
    def engines(self) -> list[StubEngine]:
        return [h.engine for h in self.handles]  # type: ignore[misc]

    def addresses(self, host: str = "127.0.0.1") -> list[str]:
        return [f"{host}:{h.port}" for h in self.handles]

    async def stop(self) -> None:
        for handle in self.handles:
            await handle.stop()


async def serve_stubs(
    count: int,
    step_s: float,
    host: str = "127.0.0.1",
    registry_url: str | None = None,
    namespace: str = "alise",
) -> StubFleet:
    """Start `count` stub executors on free ports of this event loop (registered in Redis
    when `registry_url` is set)."""
    from services.common.settings import ExecutorSettings
    from services.executor.server import start_executor

    # every stub sleeps its steps in a worker thread: one each
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=count + 4))
    handles = []
    for _ in range(count):
        settings = ExecutorSettings(
            executor_host=host,
            executor_port=0,
            metrics_port=0,
            registry_url=registry_url,
            redis_namespace=namespace,
        )
        engine = StubEngine(step_s)
        handles.append(await start_executor(settings, engine))  # type: ignore[arg-type]
    return StubFleet(handles)
