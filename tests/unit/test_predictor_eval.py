"""Evaluation figures and the validation sweep's exact search."""

from __future__ import annotations

import numpy as np
import pytest

from lab.predictor.metrics_eval import accuracy, buckets
from lab.predictor.tune import exact_topk


def test_buckets_are_128_tokens_with_an_open_last_one():
    assert buckets(np.array([0, 127, 128, 895, 896, 5000])).tolist() == [0, 0, 1, 6, 7, 7]


def test_accuracy_figures():
    true = np.array([10.0, 100.0, 200.0, 1000.0])
    pred = np.array([20.0, 130.0, 150.0, 2000.0])
    acc = accuracy(pred, true)
    assert acc["bucket_accuracy"] == pytest.approx(0.75)  # only 130 vs 100 crosses a bucket
    assert acc["mean_relative_error"] == pytest.approx((1.0 + 0.3 + 0.25 + 1.0) / 4)
    assert acc["mae"] == pytest.approx((10 + 30 + 50 + 1000) / 4)
    assert acc["kendall_tau"] == pytest.approx(1.0) and acc["spearman"] == pytest.approx(1.0)
    flipped = accuracy(pred[::-1].copy(), true)
    assert flipped["kendall_tau"] == pytest.approx(-1.0)
    assert accuracy(np.full(4, 50.0), true)["kendall_tau"] == 0.0  # constant: no ranking


def test_exact_topk_orders_by_similarity():
    base = np.eye(4, dtype=np.float32)
    lengths = np.array([1.0, 2.0, 3.0, 4.0])
    q = np.array([[0.1, 0.9, 0.3, 0.0]], np.float32)
    top = exact_topk(q, base, lengths, k=2)[0]
    assert [n.length for n in top] == [2.0, 3.0]
    assert top[0].score == pytest.approx(0.9)


def test_state_ceiling_scores_see_how_much_the_state_decides():
    """Continuations that share their state's length order perfectly by their siblings;
    continuations drawn independently of the state order at chance."""
    from lab.predictor.state_ceiling import scores

    rng = np.random.default_rng(0)
    decided = [[(n, n == 224)] * 4 for n in rng.permutation(np.arange(4, 225, 4)).tolist()]
    got = scores(decided, others=3)
    assert got["tau"] == pytest.approx(1.0) and got["cap_auc"] == pytest.approx(1.0)
    noise = [[(int(n), bool(n == 224)) for n in rng.choice([20, 80, 224], 4)] for _ in range(300)]
    for m in (1, 3):
        got = scores(noise, others=m)
        assert got["others"] == m and abs(got["tau"]) < 0.1 and abs(got["cap_auc"] - 0.5) < 0.1
