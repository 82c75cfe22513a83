"""`alise predictor calibrate`: the served model's own lengths for train-split prompts, with
the chat template, EOS honoured and one cap, several draws per prompt and the probe's features
at each checkpoint; resumable (appends, skips what is done)."""

import json

import numpy as np
import pytest

from lab.predictor.calibrate import calibrate
from services.common.settings import PredictorSettings
from services.predictor.calibration_files import (
    calibrated_samples,
    calibration_file,
    calibration_name,
    features_path,
    read_calibration,
    read_draws,
    read_features,
)
from services.predictor.sharegpt import load_split


def test_calibrate_appends_and_resumes(tmp_path):
    settings = PredictorSettings()
    out = tmp_path / "cal.jsonl"
    first = calibrate(settings, 2, max_tokens=8, out=out, batch=4, threads=1, predict_every=4)
    assert first["prompts"] == 2 and first["new"] == 2 and first["draws"] == 8  # 4 at T=1
    header, draws = read_draws(out)
    assert header["model"] == "smollm2-135m-instruct" and header["max_tokens"] == 8
    assert header["draws"] == 4 and header["temperature"] == 1.0
    for d in draws.values():
        assert len(d.lengths) == 4 and d.prompt_len > 0 and d.temperature == 1.0
        for n, cut in zip(d.lengths, d.censored):
            assert 1 <= n <= 8 and (n == 8 or not cut)  # cut by the cap: a lower bound
    feats = read_features(features_path(out))
    assert not (tmp_path / "cal.features.parts").exists()  # packed at the end of the run
    assert feats.x.shape[1] == len(feats.names) and feats.x.dtype == np.float16
    for pid, d in draws.items():  # a row per (draw, checkpoint 0, 4 while running)
        for k, n in enumerate(d.lengths):
            mine = (feats.ids == pid) & (feats.draw == k)
            assert feats.generated[mine].tolist() == [g for g in (0, 4) if g < n]
            assert (feats.remaining[mine] == n - feats.generated[mine]).all()
            assert (feats.censored[mine] == d.censored[k]).all()
    second = calibrate(settings, 3, max_tokens=8, out=out, batch=4, threads=1, predict_every=4)
    assert second["new"] == 1 and second["prompts"] == 3
    _, draws2 = read_draws(out)
    assert {k: draws2[k] for k in draws} == draws  # earlier rows kept, not recomputed
    feats2 = read_features(features_path(out))
    assert set(feats2.ids.tolist()) == set(draws2)
    assert len(feats2.select(np.isin(feats2.ids, list(draws)))) == len(feats)
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and "header" in json.loads(lines[0])
    # the rows are the first train-split prompts; the one-draw view takes the first draw
    _, rows = read_calibration(out)
    train = load_split("train")
    samples = calibrated_samples(train, rows)
    assert [s.id for s in samples] == [s.id for s in train[:3]]
    assert [s.output_len for s in samples] == [draws2[s.id].lengths[0] for s in samples]
    with pytest.raises(ValueError, match="another calibration"):
        calibrate(settings, 3, max_tokens=8, out=out, temperature=0.0, threads=1)


def test_calibration_files_both_formats(tmp_path):
    old = tmp_path / "calibration" / "m-cap16.jsonl"
    old.parent.mkdir()
    old.write_text(
        json.dumps({"header": {"model": "m", "max_tokens": 16, "temperature": 1.0}})
        + "\n"
        + json.dumps({"id": "a", "length": 16, "censored": True, "prompt_len": 5})
        + "\n"
    )
    _, draws = read_draws(old)
    assert draws["a"].lengths == (16,) and draws["a"].censored == (True,)
    assert draws["a"].temperature == 1.0
    new = tmp_path / "calibration" / calibration_name("m", 16, "train", "t0")
    assert new.name == "m-cap16-t0.jsonl"
    row = {"id": "b", "prompt_len": 7, "temperature": 0.0, "lengths": [3], "censored": [False]}
    new.write_text(json.dumps({"header": {"model": "m"}}) + "\n" + json.dumps(row) + "\n")
    assert read_draws(new)[1]["b"].median == 3.0
    assert read_calibration(new)[1]["b"] == {
        "id": "b",
        "length": 3,
        "censored": False,
        "prompt_len": 7,
    }
    assert calibration_file("m", tmp_path, 16, regime="t0") == new
    assert calibration_file("m", tmp_path, 16, regime="t1") == old  # the one-draw fallback
    assert calibration_file("m", tmp_path, 16) == old
    spread = read_draws(new)[1]["b"]
    assert spread.capped_share == 0.0 and spread.log_spread == 0.0


def test_calibration_file_lookup(tmp_path):
    assert calibration_file("no-such-model", tmp_path) is None
    mine = tmp_path / "calibration" / "m-cap16.jsonl"
    mine.parent.mkdir()
    mine.write_text("")
    assert calibration_file("m", tmp_path, 16) == mine


def test_served_eval_holds_out_every_fifth_prompt():
    from lab.predictor.served_eval import split_calibrated
    from services.predictor.sharegpt import Sample

    train = [Sample(f"s{i}", f"p{i}", "o", 5, 100 + i) for i in range(20)]
    rows = {
        f"s{i}": {"id": f"s{i}", "length": 10 * i + 5, "censored": i % 3 == 0}
        for i in range(0, 20, 2)  # every other prompt calibrated
    }
    fit, test, censored = split_calibrated(train, rows)
    assert [s.id for s in test] == ["s0", "s10"] and len(fit) == 8
    assert not {s.id for s in fit} & {s.id for s in test}
    assert [s.output_len for s in test] == [5, 105]  # the served lengths, not the references
    assert censored.tolist() == [True, False]
