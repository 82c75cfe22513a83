"""Replaying an Azure-format CSV (the public LLM inference trace's columns) in the simulator:
timestamps rescaled to a rate, the `prior` prediction for a trace without prompt text. The rows
below are made up in the trace's format; the real file is not part of the repository
(docs/simulator.md says where to get it)."""

import json

import numpy as np
import pytest

from cli.main import main
from lab.sim.predictions import PRIOR_LEN, predict_lengths
from lab.workload.traces.spec import make_trace

ROWS = [  # made-up: (seconds after 12:00:00, context tokens, generated tokens)
    (0.0, 812, 95),
    (0.4, 1530, 22),
    (0.5, 64, 310),
    (2.1, 2990, 41),
    (2.2, 377, 188),
    (3.9, 1204, 402),
    (4.0, 98, 17),
    (6.5, 5120, 63),
    (6.6, 241, 150),
    (7.3, 1011, 377),
]


@pytest.fixture
def azure_csv(tmp_path):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, p, o in ROWS:
        whole, frac = divmod(t, 1.0)
        lines.append(f"2024-03-02 12:00:{int(whole):02d}.{round(frac * 1e7):07d},{p},{o}")
    path = tmp_path / "azure_conv_sample.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_csv_replay_keeps_the_trace_shape_at_any_rate(azure_csv):
    for rate in (0.5, 4.0):
        items = make_trace(f"csv:{azure_csv}", None, rate)
        times = np.array([i.arrival_s for i in items])
        assert times[0] == 0.0 and (len(times) - 1) / times[-1] == pytest.approx(rate)
        native = np.diff([t for t, _, _ in ROWS])
        assert np.allclose(np.diff(times), native * (len(ROWS) - 1) / 7.3 / rate)
        assert [(i.prompt_len, i.output_len) for i in items] == [(p, o) for _, p, o in ROWS]
    assert len(make_trace(f"csv:{azure_csv}", 4, 1.0)) == 4  # the first rows of the file


def test_prior_prediction_is_one_constant_whatever_the_true_lengths(azure_csv):
    items = make_trace(f"csv:{azure_csv}", None, 1.0)
    lengths, source = predict_lengths(items, "prior")
    assert lengths == [PRIOR_LEN] * len(items) and source == "prior"
    assert predict_lengths(items, "prior:value=100")[0] == [100] * len(items)
    assert predict_lengths(items, "oracle")[0] == [o for _, _, o in ROWS]
    with pytest.raises(ValueError, match="prior"):
        predict_lengths(items, "prior:sigma=1")


@pytest.mark.parametrize("policy", ["hybrid:tbt_slo_s=0.1", "sarathi", "accelgen"])
def test_sim_run_replays_the_csv_with_prior_predictions(azure_csv, tmp_path, capsys, policy):
    out = tmp_path / "run.json"
    args = ["sim", "run", "--policy", policy, "--rate", "3", "--trace", f"csv:{azure_csv}"]
    args += ["--prediction", "prior", "--max-model-len", "8192", "--json", str(out)]
    assert main(args) == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == len(ROWS)
    assert summary["num_requests"] == len(ROWS) and summary["p99_tbt"] > 0
    capsys.readouterr()
