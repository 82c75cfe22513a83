"""Deterministic mode (batch_invariant.py): a request's logits, greedy tokens and logprobs are
bit-identical alone, in batches of other sizes and mixes, at other chunk sizes, and after a
preemption with recompute. bf16, a tiny random-weight Llama with 64-wide heads (the compiled
CPU kernels' size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.executor.testing import teacher_forced_logits
from lab.executor.tiny import make_tiny_model
from services.common.step import NewRequestData, SchedulerOutput
from services.executor import cpu_kernels
from services.executor.batch_invariant import TILE, tiled_linear
from services.executor.engine import Engine

# the CPU configuration needs the compiled kernels; the CUDA one (interpreted) and the products do not
needs_kernels = pytest.mark.skipif(
    not cpu_kernels.load(), reason="compiled CPU kernels unavailable"
)

PROMPT = list(range(300, 320))
OTHERS = [list(range(1000, 1031)), list(range(40, 49)), list(range(7000, 7017))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("det") / "llama", "llama", seed=3, head_dim=64)


def _engine(path, **kw) -> Engine:
    kw.setdefault("deterministic", True)
    return Engine(path, dtype="bf16", num_device_blocks=96, num_host_blocks=4, block_size=8, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_rows_do_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 96, generator=gen) * 0.1).to(dtype)
    x = torch.randn(2 * TILE + 5, 96, generator=gen).to(dtype)
    alone = tiled_linear(x[:1], w)
    for m in (2, 3, 4, TILE, TILE + 1, 2 * TILE + 5):
        assert torch.equal(tiled_linear(x[:m], w)[0], alone[0]), m
        # and in any row of a tile, next to any other rows
        shuffled = torch.cat([x[1:m], x[:1]])
        assert torch.equal(tiled_linear(shuffled, w)[m - 1], alone[0]), m
    assert (tiled_linear(x, w).float() - F.linear(x, w).float()).abs().max() < 1e-2


@needs_kernels
def test_logits_equal_alone_batched_and_chunked(tiny_dir):
    """Teacher-forced logits of PROMPT: alone in one prefill, one token a step (the decode
    path), and in mixed batches at chunk sizes 7 and 3: all bit-identical."""
    engine = _engine(tiny_dir)
    alone = teacher_forced_logits(engine, [PROMPT], [None])[0]
    by_token = teacher_forced_logits(engine, [PROMPT], [1])[0]
    mixed = teacher_forced_logits(engine, [OTHERS[0], PROMPT, OTHERS[1]], [5, 7, None])[1]
    mixed3 = teacher_forced_logits(engine, [PROMPT, *OTHERS], [3, 1, 64, 2])[0]
    for other in (by_token, mixed, mixed3):
        assert torch.equal(alone, other)


class Driver:
    """Drives an Engine greedily: requests admitted with their own blocks, each advancing its
    own chunk size a step, preempted (freed, re-admitted with prompt + output: a recompute)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.step_id, self.next_block = engine, 0, 0
        self.state: dict[str, dict] = {}
        self.out: dict[str, list[tuple[int, float]]] = {}
        self.pending = SchedulerOutput(0)

    def admit(self, rid: str, tokens: list[int], chunk: int) -> None:
        n_out = len(self.out.get(rid, []))
        self.pending.new_requests.append(NewRequestData(rid, list(tokens), num_output_tokens=n_out))
        self.pending.block_tables[rid] = (list(range(self.next_block, self.next_block + 8)), True)
        self.next_block += 8
        self.state[rid] = {"tokens": list(tokens), "done": 0, "chunk": chunk}

    def preempt_and_recompute(self, rid: str, chunk: int) -> None:
        self.pending.free_request_ids.append(rid)
        self.admit(rid, self.state.pop(rid)["tokens"], chunk)

    def step(self) -> None:
        p = self.pending
        for rid, s in self.state.items():
            p.num_scheduled_tokens[rid] = min(s["chunk"], len(s["tokens"]) - s["done"])
        out = self.engine.step(p)
        for rid, n in p.num_scheduled_tokens.items():
            self.state[rid]["done"] += n
            if rid in out.sampled:
                self.state[rid]["tokens"].append(out.sampled[rid][0])
                self.out.setdefault(rid, []).append(out.sampled[rid])
        self.step_id += 1
        self.pending = SchedulerOutput(self.step_id)


@needs_kernels
def test_greedy_output_survives_batching_and_recompute(tiny_dir):
    """PROMPT's 12 greedy tokens and their logprobs: alone, then beside requests arriving
    and leaving, prefilled in 7-token chunks, and preempted after 5 tokens and recomputed
    in 3-token chunks (other blocks, other batch)."""
    solo = Driver(_engine(tiny_dir))
    solo.admit("a", PROMPT, 64)
    while len(solo.out.get("a", [])) < 12:
        solo.step()
    busy = Driver(_engine(tiny_dir))
    busy.admit("b", OTHERS[0], 5)
    busy.admit("c", OTHERS[1], 64)
    busy.step()
    busy.admit("a", PROMPT, 7)
    recomputed = False
    while len(busy.out.get("a", [])) < 12:
        if len(busy.out.get("a", [])) == 5 and not recomputed:
            busy.preempt_and_recompute("a", 3)
            busy.admit("d", OTHERS[2], 4)
            recomputed = True
        busy.step()
    assert recomputed and len(busy.out["b"]) > 1
    assert busy.out["a"][:12] == solo.out["a"][:12]


@needs_kernels
@pytest.mark.parametrize(
    "kw", [{"attention_backend": "torch"}, {"kv_dtype": "int8"}, {"swap_compress": True}]
)
def test_configurations_it_cannot_cover_are_refused(tiny_dir, kw):
    with pytest.raises(ValueError, match="ALISE_DETERMINISTIC"):
        _engine(tiny_dir, **kw)


@needs_kernels
def test_the_setting_reaches_the_engine(tiny_dir, monkeypatch):
    from services.common.settings import ExecutorSettings

    monkeypatch.setenv("ALISE_DETERMINISTIC", "true")
    assert ExecutorSettings().deterministic
    assert _engine(tiny_dir).describe()["deterministic"]
    assert not _engine(tiny_dir, deterministic=False).describe()["deterministic"]


# -- the CUDA configuration (Triton products and attention), under Triton's interpreter ------


def test_cuda_configuration_is_batch_invariant_under_interpreter(tmp_path):
    """triton_matmul's rows do not move with the batch; a tiny Llama on the Triton backend,
    fused layer, deterministic products and attention: the same logits alone, one token a step
    and in mixed batches (tests/gpu/test_gpu_deterministic.py checks bf16 natively)."""
    from lab.executor.testing import interpreted_check

    model = make_tiny_model(tmp_path / "llama", "llama", seed=3, head_dim=16)
    result = interpreted_check(
        ["-m", "lab.executor.deterministic_check", "--engine", str(model)], timeout=300
    )
    assert result["matmul"]["max_row_change"] == 0.0, result
    assert result["matmul"]["error_vs_torch"] < 1e-4, result
    assert result["engine"] == 0.0, result


def test_uniform_tiles_give_prefill_chunks_the_decode_tile():
    from services.executor import triton_plan as plan
    from services.executor.ragged_batch import TokenRun

    runs = [TokenRun("a", list(range(9)), 0, [0, 1]), TokenRun("b", [5], 20, [2, 3, 4])]
    default = plan.plan_step(runs, 3, 2, 8, 64, 132)
    uniform = plan.plan_step(runs, 3, 2, 8, 64, 132, uniform_tiles=True)
    decode_only = plan.plan_step(runs[1:], 3, 2, 8, 64, 132)
    assert default.block_m == plan.QUERY_ROWS_PREFILL
    assert (uniform.block_m, uniform.block_q) == (decode_only.block_m, decode_only.block_q)


@needs_kernels
def test_mixtures_of_experts_and_quantized_weights_are_refused(tmp_path, tiny_dir):
    moe = make_tiny_model(tmp_path / "mixtral", "mixtral", seed=1, head_dim=64)
    with pytest.raises(ValueError, match="mixtures of experts"):
        _engine(moe)
    for mode in ("int8", "fp8"):
        with pytest.raises(ValueError, match="deterministic mode serves full-precision"):
            _engine(tiny_dir, quantization=mode)
