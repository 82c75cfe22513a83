"""`alise predictor calibrate`: the served model's own lengths for train-split prompts, with
the chat template, EOS honoured and one cap; resumable (appends, skips what is done)."""

import json

from lab.predictor.calibrate import calibrate
from services.common.settings import PredictorSettings
from services.predictor.calibration_files import (
    calibrated_samples,
    calibration_file,
    read_calibration,
)
from services.workload.traces.sharegpt import load_split


def test_calibrate_appends_and_resumes(tmp_path):
    settings = PredictorSettings()
    out = tmp_path / "cal.jsonl"
    first = calibrate(settings, 3, max_tokens=8, out=out, batch=3, threads=1)
    assert first["prompts"] == 3 and first["new"] == 3
    header, rows = read_calibration(out)
    assert header["model"] == "smollm2-135m-instruct" and header["max_tokens"] == 8
    for row in rows.values():
        assert 1 <= row["length"] <= 8 and row["prompt_len"] > 0
        if row["censored"]:
            assert row["length"] == 8  # cut by the cap: a lower bound
        else:
            assert not row["censored"]  # stopped by EOS: a true length
    second = calibrate(settings, 5, max_tokens=8, out=out, batch=4, threads=1)
    assert second["new"] == 2 and second["prompts"] == 5
    _, rows2 = read_calibration(out)
    assert {k: rows2[k] for k in rows} == rows  # earlier rows kept, not recomputed
    lines = out.read_text().splitlines()
    assert len(lines) == 6 and "header" in json.loads(lines[0])
    # the rows are the first train-split prompts, with the served length as output_len
    train = load_split("train")
    samples = calibrated_samples(train, rows2)
    assert [s.id for s in samples] == [s.id for s in train[:5]]
    assert [s.output_len for s in samples] == [rows2[s.id]["length"] for s in samples]


def test_calibration_file_lookup(tmp_path):
    assert calibration_file("no-such-model", tmp_path) is None
    mine = tmp_path / "calibration" / "m-cap16.jsonl"
    mine.parent.mkdir()
    mine.write_text("")
    assert calibration_file("m", tmp_path, 16) == mine


def test_served_eval_holds_out_every_fifth_prompt():
    from lab.predictor.served_eval import split_calibrated
    from services.workload.traces.sharegpt import Sample

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
