"""Predictions are capped at max_tokens: a request cannot outrun its own limit, so a long
prediction for a short-limited request must not push it behind longer work."""
import pytest

from tests.unit.test_core_util import drive, make_sched, req


@pytest.mark.parametrize("policy", ["alise", "hybrid"])
def test_prediction_is_capped_at_max_tokens(policy):
    s = make_sched(policy)
    r = req("r", 20, 12, predicted_len=900)
    s.add_request(r)
    assert s.policy.predicted_len(r) == 12


def test_capped_short_job_overtakes_a_long_one():
    # "capped" has a huge prediction but max_tokens 10; "long" predicts (and runs) 300
    s = make_sched("alise", max_num_seqs=1)
    long = req("long", 50, 300, t=0.0, predicted_len=300)
    capped = req("capped", 50, 10, t=0.001, predicted_len=5000)
    drive(s, [long, capped])
    assert capped.finished_time < long.finished_time


def test_demotion_never_predicts_past_max_tokens():
    s = make_sched("alise", max_num_seqs=1)
    r = req("r", 20, 40, predicted_len=4)     # outlives its prediction: demoted, doubled
    seen = []
    drive(s, [r], on_step=lambda *_: seen.append(s.policy.pred.get("r")))
    assert max(p for p in seen if p is not None) <= 40
