"""`alise bench chaos`, small: the tiny model, a scheduler leader kill and an executor kill
under load; every answer intact or cleanly refused, nothing corrupted, nothing leaked."""

import argparse

from bench.bench_chaos import chaos


def test_a_small_chaos_run_loses_nothing(tmp_path):
    args = argparse.Namespace(
        model="tiny",
        requests=24,
        faults=2,
        max_tokens=48,
        concurrency=8,
        seed=1,
        no_predictor=True,
        kinds="scheduler_kill,executor_kill",
        topology="processes",
        dtype="fp32",
    )
    out = chaos(args, tmp_path)
    assert out["reference_errors"] == 0
    assert sum(out["faults"].values()) == 2 and not out["fault_errors"]
    assert out["corrupted"] == 0, out
    assert out["intact"] + out["clean_errors"] == 24
    assert out["intact"] >= 20, out  # these faults are ridden through, not errors
    assert not any(out["leaked"].values()), out["leaked"]
