import json
import random

import pytest

from services.scheduler.core.cost_model import CostModel, roofline_profile
from services.scheduler.core.roofline import PROFILES
from tests.unit.test_core_util import req


def _samples(c, noise=0.0, n=40, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, d = rng.choice([0, 16, 64, 256, 512]), rng.randint(0, 64)
        if p == 0 and d == 0:
            d = 1
        ctx = p + d * rng.randint(10, 900)
        t = c[0] + c[1] * p + c[2] * d + c[3] * ctx
        out.append(
            {
                "prefill_tokens": p,
                "decode_tokens": d,
                "context_tokens": ctx,
                "time_s": t * (1 + rng.uniform(-noise, noise)),
            }
        )
    return out


def test_fit_recovers_coefficients_exactly_without_noise():
    true = (0.004, 8e-5, 3e-5, 2e-7)
    m = CostModel.fit(_samples(true))
    for got, want in zip((m.c0, m.c_prefill, m.c_decode, m.c_context), true):
        assert got == pytest.approx(want, rel=1e-6)
    assert m.fit_error < 1e-9


def test_fit_with_noise_is_close_and_non_negative():
    m = CostModel.fit(_samples((0.004, 8e-5, 3e-5, 0.0), noise=0.05, seed=3))
    assert min(m.c0, m.c_prefill, m.c_decode, m.c_context) >= 0
    assert m.c_prefill == pytest.approx(8e-5, rel=0.15)
    assert 0 < m.fit_error < 0.1


def test_profile_roundtrip_and_file(tmp_path):
    m = CostModel.fit(_samples((0.002, 1e-4, 5e-5, 1e-7)), device="cpu", model="tiny")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(m.to_profile()))
    again = CostModel.from_profile(path)
    assert again.iteration_time(100, 10, 900) == pytest.approx(m.iteration_time(100, 10, 900))
    assert (again.t0, again.alpha, again.beta) == pytest.approx((m.t0, m.alpha, m.beta))
    only_samples = CostModel.from_profile({"samples": m.samples})
    assert only_samples.c0 == pytest.approx(m.c0)


def test_bad_profiles_rejected():
    with pytest.raises(ValueError):
        CostModel.from_profile({"device": "x"})
    with pytest.raises(ValueError):
        CostModel.fit([{"prefill_tokens": 1, "decode_tokens": 0, "time_s": 1.0}] * 3)
    with pytest.raises(ValueError):
        CostModel(c0=-1.0, c_prefill=0.0, c_decode=0.0)


def test_alise_model_and_remaining_time():
    m = CostModel(c0=0.01, c_prefill=1e-4, c_decode=1e-4, c_context=1e-6)
    assert m.alpha == 1e-6 and m.beta == pytest.approx(0.0101)
    assert m.prefill_time(100) == pytest.approx(100 * m.t0)
    assert m.decode_time(100, 10) == pytest.approx(10 * (1e-6 * 100 + 0.0101))
    r = req("a", 100, 50)
    fresh = m.remaining_time(r, 20)
    assert fresh > m.remaining_time(r, 10) > 0
    r.num_computed_tokens = 104
    r.output_token_ids = [1] * 5
    assert m.remaining_time(r, 20) < fresh
    r.num_computed_tokens = 119
    r.output_token_ids = [1] * 20
    assert m.remaining_time(r, 20) == 0.0


def test_token_budget_respects_tbt_and_tile():
    m = CostModel(c0=0.01, c_prefill=1e-4, c_decode=1e-4, c_context=0.0)
    b = m.token_budget(0.05, tile_size=64)
    assert b % 64 == 0 and m.iteration_time(b, 0, 0) <= 0.05 < m.iteration_time(b + 64, 0, 0)
    assert m.token_budget(0.001, tile_size=32) == 32  # never below one tile
    s_b = m.accelgen_budget(2 * m.pivot_time_s)
    assert s_b == pytest.approx(2 * m.pivot_tokens, abs=1)


@pytest.mark.parametrize("name", PROFILES)
def test_roofline_profiles_are_sane(name):
    p = roofline_profile(name)
    m = CostModel.from_profile(p)
    # a 256-way decode step is memory bound: tens of ms; a 2k prefill is compute bound
    assert 0.005 < m.iteration_time(0, 256, 256 * 512) < 0.5
    assert m.iteration_time(2048, 0, 2048) > m.iteration_time(0, 1, 512)
    assert p["num_device_blocks"] > 100 and p["kv_bytes_per_token"] > 0
    assert 10 < m.pivot_tokens < 2000


def test_roofline_orders_hardware_and_rejects_unknown():
    v100 = CostModel.from_profile(roofline_profile("v100-32g/opt-13b"))
    h100 = CostModel.from_profile(roofline_profile("h100-80g/llama-3-8b"))
    assert h100.iteration_time(512, 32, 9000) < v100.iteration_time(512, 32, 9000)
    with pytest.raises(ValueError, match="known"):
        roofline_profile("tpu/llama")


def _curved_samples():
    """A CPU-like profile: decode steps 20% above a linear law, prefills on it."""
    c = (0.05, 0.003, 0.003, 3e-5)
    out = []
    for p in (16, 64, 256, 512):
        out.append(
            {
                "prefill_tokens": p,
                "decode_tokens": 0,
                "context_tokens": p,
                "time_s": c[0] + c[1] * p + c[3] * p,
            }
        )
    for d, ctx in ((1, 128), (1, 512), (4, 512), (8, 4096), (32, 16384), (64, 8192)):
        t = c[0] + c[2] * d + c[3] * ctx
        out.append(
            {
                "prefill_tokens": 0,
                "decode_tokens": d,
                "context_tokens": ctx,
                "time_s": t * (1.3 if d <= 4 else 1.0),
            }
        )
    return out


def test_measured_time_follows_the_profile_samples():
    samples = _curved_samples()
    cost = CostModel.fit(samples)
    for s in samples:  # at a measured shape: the measurement itself
        got = cost.measured_time(s["prefill_tokens"], s["decode_tokens"], s["context_tokens"])
        assert got == pytest.approx(s["time_s"], rel=1e-9)
    # a small decode step between measured ones takes the small decodes' ratio, which the
    # fit (pulled between the 1.3x and 1.0x groups) cannot
    fit, measured = cost.iteration_time(0, 2, 300), cost.measured_time(0, 2, 300)
    truth = (0.05 + 0.003 * 2 + 3e-5 * 300) * 1.3
    assert abs(measured - truth) < abs(fit - truth)
    assert abs(measured / truth - 1) < 0.08
    # a prefill is corrected by prefill samples (on the law), not by the slow decodes
    p_truth = 0.05 + 0.003 * 128 + 3e-5 * 128
    assert cost.measured_time(128, 0, 128) == pytest.approx(p_truth, rel=0.08)
    assert cost.measured_time(0, 0, 0) == 0.0


def test_measured_time_is_the_fit_without_samples():
    cost = CostModel.from_profile(roofline_profile("a100-80g/llama-2-7b"))
    assert not cost.samples
    assert cost.measured_time(300, 12, 4000) == cost.iteration_time(300, 12, 4000)
