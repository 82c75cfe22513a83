"""What the profiler and the warm-up need of an engine, as protocols: its geometry, the requests
it holds and `step` (plus, for the warm-up, its device, attention backend and CUDA runtime).
`Engine` satisfies both; they type against these, so they need not import the engine that
calls them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from services.common.step import SchedulerOutput
    from services.executor.attention_backends import Attention
    from services.executor.config import ModelSpec
    from services.executor.cuda_runtime import DeviceRuntime
    from services.executor.messages import RequestState, StepOutput


class SteppingEngine(Protocol):
    block_size: int
    max_model_len: int
    requests: dict[str, RequestState]

    @property
    def num_device_blocks(self) -> int: ...

    @property
    def num_host_blocks(self) -> int: ...

    def step(self, step: SchedulerOutput, all_logits: bool = False) -> StepOutput: ...

    def describe(self) -> dict: ...

    def exclusive(self) -> AbstractContextManager[Any]: ...


class WarmableEngine(SteppingEngine, Protocol):
    device: torch.device
    spec: ModelSpec
    attn: Attention
    runtime: DeviceRuntime | None
