"""Start-up of an executor: loading -> warming -> serving (or failed), and the warm-up itself.

gRPC health says NOT_SERVING until the phase is `serving`; Steps before then are refused
(UNAVAILABLE). A failure in loading or warming is final: the reason is logged on one line and
`alise executor serve` exits non-zero.

Warm-up (CUDA, or the Triton backend anywhere) runs a fixed sequence of real steps on the
engine's own pool and frees them, then captures the CUDA graphs. Triton compiles one kernel
per specialisation of its integer arguments (== 1, divisible by 16, other) unless told not to:
the kernels pass the integers that vary from step to step (token and tile counts, table
width, the quantizer's source size) unspecialised (triton_kernels.STEP_VARYING), so the
variants left are those of the constexprs. The steps run prefill chunks, decodes and mixed
batches (block tables of 1, 16 and another number of columns), then every split-KV factor a
long decode step can take is compiled with its reduce kernel (TritonAttention.warm_splits);
sampling runs greedy and with temperature, top-k, top-p, a seed, a penalty and
top-logprobs. On the plain CPU path nothing is compiled and warm-up runs no step.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from services.common.arith import ceil_div
from services.common.sampling import SamplingParams
from services.common.step import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from services.executor.cuda_graphs import Capture
    from services.executor.engine_protocol import WarmableEngine


class Phase(enum.Enum):
    LOADING = "loading"
    WARMING = "warming"
    SERVING = "serving"
    FAILED = "failed"


NEXT = {
    Phase.LOADING: {Phase.WARMING, Phase.FAILED},
    Phase.WARMING: {Phase.SERVING, Phase.FAILED},
    Phase.SERVING: set(),
    Phase.FAILED: set(),
}


def one_line(exc: BaseException) -> str:
    """`Type: message` on a single line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class Startup:
    """The start-up state machine: loading -> warming -> serving; loading or warming ->
    failed (with its reason). Any other move raises."""

    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.reason = ""

    def advance(self, phase: Phase, reason: str = "") -> None:
        if phase not in NEXT[self.phase]:
            raise RuntimeError(
                f"executor start-up cannot go from {self.phase.value} to {phase.value}"
            )
        self.phase, self.reason = phase, reason

    def fail(self, exc: BaseException) -> str:
        reason = one_line(exc)
        self.advance(Phase.FAILED, reason)
        return reason

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING


# -- the warm-up steps ------------------------------------------------------------------------

SAMPLED = SamplingParams(
    temperature=0.8, top_k=40, top_p=0.9, seed=7, repetition_penalty=1.1, top_logprobs=2
)


def warmup_lengths(block_size: int, max_model_len: int, num_blocks: int) -> dict[str, int]:
    """Prompt lengths of the warm-up requests: a 1-token prompt (1 block-table column), one
    filling 16 columns and one of 2 columns, each decoding 2 tokens later; capped at the
    model's length, and only the first when the pool cannot hold all three."""
    bs, cap = block_size, max(1, max_model_len - 2)
    lens = {"warmup-a": 1, "warmup-b": min(16 * bs - 2, cap), "warmup-c": min(2 * bs, cap)}
    if sum(ceil_div(n + 2, bs) for n in lens.values()) > num_blocks:
        return {"warmup-a": 1}
    return lens


def warmup_steps(
    block_size: int, max_model_len: int, num_blocks: int, vocab: int
) -> list[SchedulerOutput]:
    """The warm-up schedule: each prompt alone, then all decoding, then two of them decoding
    (the long one freed), then everything freed. Blocks are taken from 0 upwards."""
    lens = warmup_lengths(block_size, max_model_len, num_blocks)
    steps, next_block = [], 0
    for i, (rid, n) in enumerate(lens.items()):
        blocks = list(range(next_block, next_block + ceil_div(n + 2, block_size)))
        next_block += len(blocks)
        ids = [(i * 131 + j * 17 + 7) % vocab for j in range(n)]
        params = SAMPLED if rid == "warmup-b" else SamplingParams()
        steps.append(
            SchedulerOutput(
                len(steps),
                new_requests=[NewRequestData(rid, ids, params)],
                block_tables={rid: (blocks, False)},
                num_scheduled_tokens={rid: n},
            )
        )
    rids = list(lens)
    steps.append(SchedulerOutput(len(steps), num_scheduled_tokens=dict.fromkeys(rids, 1)))
    rest = [r for r in rids if r != "warmup-b"]
    steps.append(
        SchedulerOutput(
            len(steps),
            free_request_ids=[r for r in rids if r == "warmup-b"],
            num_scheduled_tokens=dict.fromkeys(rest, 1),
        )
    )
    steps.append(SchedulerOutput(len(steps), free_request_ids=rest))
    return steps


TRITON_MODULES = (
    "services.executor.triton_kernels",
    "services.executor.triton_fused",
    "services.executor.triton_moe",
)


def triton_variants() -> int:
    """Compiled Triton kernel variants in this process (every kernel of TRITON_MODULES,
    every device), 0 without Triton."""
    import importlib

    total = 0
    for name in TRITON_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in vars(module).values():
            caches = getattr(obj, "device_caches", None)
            if isinstance(caches, dict):
                total += sum(len(c[0]) for c in caches.values())
    return total


def needs_warmup(engine: WarmableEngine) -> bool:
    """Whether anything is compiled or captured: CUDA, or the Triton backend."""
    return engine.device.type == "cuda" or engine.attn.name == "triton"


def warm_up_engine(engine: WarmableEngine, capture: Capture | None = None) -> dict:
    """Run the warm-up steps and capture the CUDA graphs; returns what was done."""
    start = time.perf_counter()
    steps = []
    if needs_warmup(engine):
        steps = warmup_steps(
            engine.block_size,
            engine.max_model_len,
            engine.num_device_blocks,
            engine.spec.vocab_size,
        )
        for step in steps:
            engine.step(step)
        if engine.requests:
            raise RuntimeError(f"warm-up left requests behind: {sorted(engine.requests)}")
        if engine.attn.name == "triton":  # split-KV: long decode steps outside the graphs
            from services.executor.triton_attention import TritonAttention

            assert isinstance(engine.attn, TritonAttention)
            engine.attn.warm_splits(engine.cache, engine.dtype, engine.max_model_len)
    graphs: list[int] = []
    failure = ""
    if engine.runtime is not None:
        engine.runtime.capture_graphs(capture)
        graphs, failure = sorted(engine.runtime.graphs.replays), engine.runtime.graphs.failure
    return {
        "steps": len(steps),
        "seconds": time.perf_counter() - start,
        "cuda_graphs": graphs,
        "cuda_graph_failure": failure,
        "triton_variants": triton_variants(),
    }
