"""The cost model of a mixture of experts: a step's expert weights follow the experts its
tokens are routed to (Experts.read), the fit recovers that term, the TBT token budget accounts
for it, and an executor's profile of a tiny MoE carries it with its parameter counts."""

from __future__ import annotations

import pytest

from services.scheduler.core.cost_model import CostModel, Experts

QWEN3_30B = Experts(num_experts=128, top_k=8, layers=48)


def test_experts_read_grow_from_top_k_to_all_experts():
    reads = [QWEN3_30B.read(t) for t in (1, 2, 8, 32, 256, 4096)]
    assert reads[0] == pytest.approx(48 * 8)
    assert reads == sorted(reads) and reads[-1] == pytest.approx(48 * 128, rel=1e-6)
    assert QWEN3_30B.read(2) - QWEN3_30B.read(1) < reads[0]  # concave: overlaps


def _samples(model: CostModel) -> list[dict]:
    grid = [(p, 0, p) for p in (16, 64, 256)] + [
        (0, d, d * c) for d in (1, 4, 16, 64) for c in (64, 512)
    ]
    return [
        {"prefill_tokens": p, "decode_tokens": d, "context_tokens": c,
         "time_s": model.iteration_time(p, d, c)}
        for p, d, c in grid
    ]  # fmt: skip


def test_the_fit_recovers_the_expert_term_and_a_profile_keeps_it():
    truth = CostModel(2e-3, 1e-5, 3e-5, 1e-8, experts=QWEN3_30B, c_expert=2e-6)
    fitted = CostModel.fit(_samples(truth), experts=QWEN3_30B)
    assert fitted.c_expert == pytest.approx(2e-6, rel=1e-3)
    assert fitted.fit_error < 1e-6
    again = CostModel.from_profile(fitted.to_profile())
    assert again.experts == QWEN3_30B and again.c_expert == pytest.approx(fitted.c_expert)
    dense = CostModel.fit(_samples(truth))  # the same times fitted without the term
    assert dense.fit_error > 10 * fitted.fit_error


@pytest.mark.parametrize("decodes", [0, 8, 64])
def test_the_token_budget_is_the_largest_chunk_within_the_tbt(decodes):
    model = CostModel(2e-3, 1e-5, 3e-5, 1e-8, experts=QWEN3_30B, c_expert=2e-6)
    tbt = 0.05
    n = model.token_budget(tbt, decode_tokens=decodes, context_tokens=decodes * 256)
    chunk = n - decodes
    assert model.iteration_time(chunk, decodes, decodes * 256 + chunk) <= tbt
    assert model.iteration_time(chunk + 1, decodes, decodes * 256 + chunk + 1) > tbt
    # with the routed experts' time left out, the budget would be larger (too large)
    dense = CostModel(2e-3, 1e-5, 3e-5, 1e-8)
    assert dense.token_budget(tbt, decode_tokens=decodes, context_tokens=decodes * 256) > n


def test_a_tiny_moe_profile_carries_the_expert_term_and_parameter_counts(tmp_path):
    from lab.executor.tiny import make_tiny_model
    from services.executor.engine import Engine

    model_dir = make_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=3, head_dim=64)
    engine = Engine(model_dir, device="cpu", dtype="fp32", num_device_blocks=64)
    profile = engine.profile(quick=True)
    assert profile["moe"] == {"num_experts": 8, "top_k": 3, "layers": 2}  # layer 1 is dense
    assert "c_expert" in profile["coefficients"]
    params = profile["params"]
    assert params["active_per_token"] < params["total"]
    # per MoE layer, 8 - 3 experts of (2 x 32 + 32) x 64 weights are not read per token
    assert params["total"] - params["active_per_token"] == 2 * 5 * 96 * 64
    assert CostModel.from_profile(profile).experts == Experts(8, 3, 2)
