"""The executor's remaining-length probe on a tiny random-weight model: the probe file
round-trips, forecasts come exactly at the checkpoints, a request's features do not depend on
its batch, and the feature statistics mean what they say."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lab.executor.driver import Driver
from lab.executor.tiny import make_tiny_model
from services.common.sampling import SamplingParams
from services.executor.engine import Engine
from services.executor.probe import (
    SCALAR_NAMES,
    Probe,
    ProbeBank,
    ProbeHook,
    feature_names,
    repeat_share,
    token_stats,
)

EVERY = 4
PROMPTS = [list(range(200, 230)), list(range(1000, 1013)), list(range(5000, 5050)), [300, 301]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=3)


def random_probe(width: int, cap: int, regime: str, seed: int = 0, hidden: int = 8) -> Probe:
    rng = np.random.default_rng(seed)
    arrays = {
        "mean": rng.normal(size=width).astype(np.float32),
        "std": rng.uniform(0.5, 2, size=width).astype(np.float32),
        "w0": rng.normal(scale=0.3, size=(width, hidden)).astype(np.float32),
        "b0": rng.normal(size=hidden).astype(np.float32),
        "w1": rng.normal(scale=0.3, size=(hidden, 4)).astype(np.float32),
        "b1": np.array([3.0, 0.5, 0.5, 0.0], np.float32),
    }
    names = feature_names(width - len(SCALAR_NAMES))
    return Probe(arrays, {"model": "tiny", "cap": cap, "regime": regime, "names": names})


def _engine(tiny_dir, record: bool = False) -> Engine:
    return Engine(
        tiny_dir,
        dtype="fp32",
        num_device_blocks=64,
        num_host_blocks=4,
        predict_every=EVERY,
        record_features=record,
    )


def test_probe_file_round_trips(tmp_path):
    probe = random_probe(len(SCALAR_NAMES) + 16, 256, "t1")
    path = tmp_path / "tiny" / "cap256-t1.npz"
    probe.save(path)
    back = Probe.load(path)
    assert back.meta == probe.meta and (back.cap, back.regime) == (256, "t1")
    x = torch.randn(5, len(SCALAR_NAMES) + 16)
    assert torch.equal(back.raw(x), probe.raw(x))
    q = back.raw(x)
    assert bool((q[:, 0] <= q[:, 1]).all() and (q[:, 1] <= q[:, 2]).all())  # ordered quantiles
    bank = ProbeBank.for_model("tiny", tmp_path)
    assert bank is not None and bank.pick(256, 1.0) is not None
    assert bank.pick(256, 0.0) is None  # no greedy probe: no forecast
    assert ProbeBank.for_model("other", tmp_path) is None


def _record_steps(engine: Engine) -> list:
    """Wrap engine.step to keep (output tokens before the step per request, the outcome)."""
    seen: list = []
    step = engine.step

    def recording(s, all_logits=False):
        before = {r: st.num_output_tokens for r, st in engine.requests.items()}
        out = step(s, all_logits)
        seen.append((before, out))
        return out

    engine.step = recording  # type: ignore[method-assign]
    return seen


def test_forecasts_at_exactly_the_checkpoints(tiny_dir):
    engine = _engine(tiny_dir)
    assert engine.probe is None  # no probe shipped for the tiny model: off
    width = len(SCALAR_NAMES) + engine.spec.hidden_size
    bank = ProbeBank([random_probe(width, 32, "t1"), random_probe(width, 32, "t0", seed=1)])
    engine.probe = ProbeHook(EVERY, bank, False, [])
    seen = _record_steps(engine)
    seqs = Driver(engine, token_budget=16).generate(PROMPTS, [13, 9, 13, 5], SamplingParams())
    assert [len(s.output) for s in seqs] == [13, 9, 13, 5]
    made = {}
    for before, out in seen:
        for rid in out.sampled:
            g = before.get(rid, 0)
            at_checkpoint = g % EVERY == 0
            assert (rid in out.forecasts) == at_checkpoint, (rid, g)
            if at_checkpoint:
                fc = out.forecasts[rid]
                assert fc.generated == g and 1 <= fc.q10 <= fc.q50 <= fc.q90 and 0 <= fc.p_cap <= 1
                made.setdefault(rid, []).append(g)
    assert made == {"r0": [0, 4, 8, 12], "r1": [0, 4, 8], "r2": [0, 4, 8, 12], "r3": [0, 4]}


def _features(tiny_dir, prompts: list[list[int]], token_budget: int) -> list:
    engine = _engine(tiny_dir, record=True)
    seqs = Driver(engine, token_budget=token_budget).generate(prompts, 10, SamplingParams())
    return seqs


def test_features_do_not_depend_on_the_batch(tiny_dir):
    alone = _features(tiny_dir, PROMPTS[:1], 64)[0]
    batched = _features(tiny_dir, PROMPTS[1:3] + PROMPTS[:1] + PROMPTS[3:], 24)[2]
    assert alone.output == batched.output
    assert [g for g, _ in alone.features] == [0, 4, 8]
    assert [g for g, _ in batched.features] == [0, 4, 8]
    for (_, a), (_, b) in zip(alone.features, batched.features):
        # fp32 tiny model: the same request's rows differ by kernel rounding only (measured
        # max 2e-6 here; the bound leaves room for other CPUs' matrix kernels)
        assert np.abs(a - b).max() < 1e-3


def test_token_stats_and_repeat_share():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, -10.0, -10.0, -10.0]])
    entropy, p_eos, probs = token_stats(logits, [1])
    assert entropy[0].item() == pytest.approx(np.log(4), abs=1e-5)
    assert entropy[1].item() < 1e-3
    assert p_eos[0].item() == pytest.approx(0.25) and p_eos[1].item() < 1e-6
    assert torch.allclose(probs, torch.softmax(logits, dim=-1), atol=1e-6)  # the sampler's
    assert repeat_share([1, 2, 3, 4, 5, 6, 7, 8], 4) == 0.0
    loop = [1, 2, 3, 4] * 4
    assert repeat_share(loop, 4) == 1.0  # a looping answer: every recent 4-gram seen before


def test_a_planted_wrong_probe_ranks_worse_than_the_shipped_one():
    """The shipped SmolLM2 probe (sampled regime) on the committed held-out draws, against
    the same probe with its q50 and P(cap) outputs negated (so it ranks backwards)."""
    from lab.predictor.progressive import checkpoint_metrics, predict
    from services.predictor.calibration_files import DRAWS, features_path, read_features

    name = "smollm2-135m-instruct-cap256-t1-test.jsonl"
    rows = read_features(features_path(DRAWS / name))
    bank = ProbeBank.for_model("smollm2-135m-instruct")
    assert bank is not None
    probe = bank.pick(256, 1.0)
    assert probe is not None and probe.regime == "t1"
    last = max(k for k in probe.arrays if k.startswith("w"))
    arrays = dict(probe.arrays)
    flip = np.array([-1.0, 1.0, 1.0, -1.0], np.float32)  # q50 and the P(cap) logit
    arrays[last] = arrays[last] * flip
    arrays["b" + last[1:]] = arrays["b" + last[1:]] * flip
    wrong = Probe(arrays, probe.meta)
    taus = {}
    for tag, p in (("real", probe), ("wrong", wrong)):
        pred = predict(p, rows, 256)
        per = []
        for g in (32, 64, 96, 128):
            mask = rows.generated == g
            per.append(checkpoint_metrics({k: v[mask] for k, v in pred.items()}, rows.select(mask)))
        taus[tag] = float(np.mean([m["tau"] for m in per]))
    assert taus["real"] > 0.05
    assert taus["wrong"] < taus["real"] - 0.1, taus
