"""`alise bench hybrid-knobs` on a tiny point: it runs the simulator for the defaults (every
noise seed) and each alternative, and judges each knob from the figures."""

import pytest

from bench.bench_hybrid_knobs import NOISE_SEEDS, PAPER_KNOBS, POINTS, entry, report
from services.scheduler.core.policies import make_policy, policy_knobs


def test_tiny_point_reports_figures_noise_and_a_verdict_per_knob():
    alternatives = {"max_window": [4], "max_skips": [256]}
    r = report(alternatives, POINTS[2:3], num_requests=40, jobs=1)
    (point,) = r["points"]
    assert point == "sharegpt@22" and r["noise_seeds"] == list(NOISE_SEEDS)
    default = r["default"][point]
    assert default["mean_normalized_latency"] > 0 and 0 <= default["slo_attainment"] <= 1
    assert set(r["noise_band"][point]) == set(r["metrics"])
    assert all(v >= 0 for v in r["noise_band"][point].values())
    for knob, values in alternatives.items():
        figures = r["knobs"][knob]
        assert figures["verdict"] in ("identical", "within noise", "effect")
        assert set(figures["alternatives"]) == {entry(knob, v) for v in values}
        if figures["verdict"] == "identical":
            assert figures["alternatives"][entry(knob, values[0])][point] == default


def test_entries_are_sim_policy_entries_and_paper_knobs_exist():
    assert entry(None) == "hybrid"
    assert entry("preempt_level_gap", None) == "hybrid:preempt_level_gap=null"
    assert entry("prefill_lane", False) == "hybrid:prefill_lane=false"
    assert entry("rank", "remaining") == "hybrid:rank=remaining"
    assert set(PAPER_KNOBS) <= set(policy_knobs("hybrid"))
    make_policy("hybrid", preempt_level_gap=None, prefill_lane=False, rank="remaining")


def test_measured_knobs_exist_and_cut_ones_are_refused():
    from bench.bench_hybrid_knobs import ALTERNATIVES, CUT

    knobs = policy_knobs("hybrid")
    assert set(ALTERNATIVES) <= set(knobs) and not set(ALTERNATIVES) & set(PAPER_KNOBS)
    for knob in CUT:
        assert knob not in knobs
        with pytest.raises(ValueError, match="valid knobs"):
            make_policy("hybrid", **{knob: CUT[knob][0]})


def test_paired_look_runs_defaults_and_alternatives_at_the_same_seeds():
    from bench.bench_hybrid_knobs import paired

    r = paired({"preempt_level_gap": [None]}, POINTS[2], seeds=2, num_requests=30, jobs=1)
    assert r["point"] == "sharegpt@22"
    assert set(r["figures"]) == {"hybrid", "hybrid:preempt_level_gap=null"}
    for per_seed in r["figures"].values():
        assert set(per_seed) == {"0", "1"}
        assert all(row["mean_normalized_latency"] > 0 for row in per_seed.values())
    assert r["figures"]["hybrid"]["0"] != r["figures"]["hybrid"]["1"]  # the seed matters
