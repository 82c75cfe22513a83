"""Temperature regimes and several draws per prompt: reading both calibration formats, the
per-prompt summary (median, cut share, spread) and the MLP's spread head."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.predictor.core import combine_spread, decide
from services.predictor.mlp import MlpConfig, MlpRegressor, train
from services.predictor.regimes import (
    PromptDraws,
    file_tag,
    read_draws,
    regime_file,
    regime_of,
    summarize_draws,
)
from services.predictor.store_base import Neighbor


def test_regime_of_temperature():
    assert regime_of(None) == "t1"  # not sent: the API default 1.0
    assert regime_of(1.0) == regime_of(0.7) == regime_of(2.0) == "t1"
    assert regime_of(0.0) == "t0"  # greedy, as the executor's sampler decides it


def test_summary_of_several_draws_and_of_one():
    many = PromptDraws("a", 9, 1.0, (30, 10, 256, 20), (False, False, True, False))
    s = summarize_draws(many)
    assert (s.length, s.capped, s.count) == (20.0, 0.25, 4)  # median of the three that ended
    assert s.spread == pytest.approx(np.log1p([30, 10, 256, 20]).std())
    one = summarize_draws(PromptDraws("b", 9, 1.0, (77,), (False,)))
    assert (one.length, one.capped, one.spread, one.count) == (77.0, 0.0, 0.0, 1)
    cut = summarize_draws(PromptDraws("c", 9, 1.0, (256, 256), (True, True)))
    assert (cut.length, cut.capped) == (256.0, 1.0)  # all cut: the cap, a lower bound
    assert cut.spread == 0.0


def test_regime_files_and_their_tags(tmp_path):
    cal = tmp_path / "calibration"
    cal.mkdir()
    header = {"header": {"model": "m", "max_tokens": 256, "temperature": 0.0}}
    row = {"id": "x", "prompt_len": 3, "temperature": 0.0, "lengths": [5], "censored": [False]}
    (cal / "m-cap256-t0.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(row) + "\n")
    t0 = regime_file("m", tmp_path, "t0")
    assert t0 == cal / "m-cap256-t0.jsonl" and file_tag(t0) == "cal256-t0"
    assert regime_file("m", tmp_path, "t1") is None  # no file of either name
    head, draws = read_draws(t0)
    assert head["temperature"] == 0.0 and draws["x"].lengths == (5,)
    # the older one-draw file is the t1 regime's (bundled for SmolLM2), with the older tag
    legacy = regime_file("smollm2-135m-instruct", tmp_path, "t1")
    assert legacy is not None and file_tag(legacy).startswith("cal256")
    old = [
        json.dumps(header),
        json.dumps({"id": "y", "length": 9, "censored": True, "prompt_len": 2}),
    ]
    (cal / "m-cap256.jsonl").write_text("\n".join(old) + "\n")
    one = regime_file("m", tmp_path, "t1")
    assert one == cal / "m-cap256.jsonl" and file_tag(one) == "cal256"
    assert read_draws(one)[1]["y"].lengths == (9,) and read_draws(one)[1]["y"].censored == (True,)
    assert regime_file("no-such-model", tmp_path, "t0") is None


def test_spread_of_neighbours_and_mlp_reaches_the_prediction():
    nbs = [Neighbor("a", 0.9, 100.0, 4, spread=0.5), Neighbor("b", 0.95, 50.0, 1, spread=0.0)]
    assert combine_spread(nbs, 0.8) == pytest.approx(0.5)  # "b" does not know its spread
    hit = decide(nbs, mlp=None, prior=1.0, s0=0.8)
    assert hit.source == "retrieval" and hit.spread == pytest.approx(0.5)
    miss = decide(None, mlp=(40.0, 0.1, 0.7), prior=1.0, s0=0.8)
    assert (miss.source, miss.spread) == ("mlp", 0.7)


def test_mlp_learns_median_cut_share_and_spread(tmp_path):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((400, 8)).astype(np.float32)
    feat = rng.random(400).astype(np.float32)
    lengths = np.where(emb[:, 0] > 0, 200.0, 20.0)  # the median of the draws that ended
    share = np.where(emb[:, 2] > 0, 0.75, 0.0)  # share of draws cut at the cap
    spread = np.where(emb[:, 1] > 0, 0.9, 0.1)
    spread[::5] = np.nan  # one-draw prompts: spread unknown
    model = train(
        emb, feat, lengths, MlpConfig(dim=8, hidden=32), epochs=60, lr=3e-3, batch=32,
        log=None, censored=share, spread=spread,
    )  # fmt: skip
    assert model.cfg.capped_head and model.cfg.spread_head
    x, f = emb[:200], feat[:200]
    got = model.predict_spread(x, f)
    assert np.mean((got > 0.5) == (x[:, 1] > 0)) > 0.9
    assert np.mean((model.predict_capped(x, f) > 0.375) == (x[:, 2] > 0)) > 0.9
    assert np.mean((model.predict(x, f) > 60) == (lengths[:200] > 60)) > 0.9
    model.save(tmp_path / "mlp.pt")
    again = MlpRegressor.load(tmp_path / "mlp.pt")
    np.testing.assert_allclose(again.predict_spread(x[:5], f[:5]), got[:5], rtol=1e-5)
    plain = train(emb, feat, lengths, MlpConfig(dim=8, hidden=8), epochs=2, log=None)
    assert not plain.cfg.spread_head and not plain.predict_spread(x[:3], f[:3]).any()
