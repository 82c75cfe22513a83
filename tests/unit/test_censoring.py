"""Censored output lengths (answers cut by max_tokens): the expected length the scheduler
uses, store points' running statistics, retrieval's and the MLP's P(runs to the cap)."""

from __future__ import annotations

import numpy as np
import pytest

from lab.predictor.served_eval import auc, score
from services.common.censoring import expected_length, merge_censored
from services.predictor.core import combine
from services.predictor.mlp import train
from services.predictor.store_base import Neighbor


def test_expected_length_weighs_the_cap_by_p_capped():
    assert expected_length(100, 0.0, 256) == 100
    assert expected_length(400, 0.0, 256) == 256  # never past max_tokens
    assert expected_length(100, 1.0, 256) == 256
    assert expected_length(100, 0.5, 256) == 178  # 0.5 * 100 + 0.5 * 256
    assert expected_length(100, 0.5, 1024) == 562
    assert expected_length(0, 0.0, 16) == 1
    assert expected_length(100, 7.0, 64) == 64  # clamped probability


def test_merge_keeps_the_mean_of_answers_that_ended():
    length, count, capped = merge_censored(100.0, 1, 0.0, 256, censored=True)
    assert (length, count, capped) == (100.0, 2, 0.5)  # the cut one does not move the mean
    length, count, capped = merge_censored(length, count, capped, 50, censored=False)
    assert (length, count) == (75.0, 3) and capped == pytest.approx(1 / 3)
    # a point that only saw cut answers keeps their largest lower bound
    length, count, capped = merge_censored(256.0, 1, 1.0, 512, censored=True)
    assert (length, count, capped) == (512.0, 2, 1.0)
    length, count, capped = merge_censored(length, count, capped, 30, censored=False)
    assert (length, count) == (30.0, 3) and capped == pytest.approx(2 / 3)


def test_combine_averages_the_uncensored_part_and_reports_p_capped():
    nbs = [Neighbor("a", 0.9, 100.0, 1, capped=0.0), Neighbor("b", 0.9, 256.0, 1, capped=1.0)]
    length, used, p = combine(nbs, s0=0.8)
    assert (length, used, p) == (100.0, 2, 0.5)
    all_cut = [Neighbor("a", 0.9, 256.0, 2, capped=1.0)]
    assert combine(all_cut, s0=0.8) == (256.0, 1, 1.0)


def test_mlp_learns_the_cap_probability_and_ignores_cut_lengths():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(600, 8)).astype(np.float32)
    cut = emb[:, 0] > 0  # the first coordinate says whether the answer runs to the cap
    lengths = np.where(cut, 256.0, 40.0 + 10 * (emb[:, 1] > 0)).astype(np.float32)
    feat = np.zeros(600, np.float32)
    mlp = train(emb[:500], feat[:500], lengths[:500], epochs=80, log=None, censored=cut[:500])
    p = mlp.predict_capped(emb[500:], feat[500:])
    assert auc(p, cut[500:]) > 0.9
    # the length head learnt the answers that ended (40-50 tokens), not the cap
    assert np.median(mlp.predict(emb[500:], feat[500:])) < 80
    plain = train(emb[:500], feat[:500], lengths[:500], epochs=5, log=None)
    assert not plain.cfg.capped_head and not plain.predict_capped(emb[:3]).any()


def test_served_score_excludes_cut_answers_from_tau_and_reports_them_apart():
    pred = np.array([250.0, 40.0, 60.0, 80.0])
    p_capped = np.array([0.9, 0.1, 0.0, 0.2])
    true = np.array([256.0, 30.0, 70.0, 90.0])
    got = score(pred, p_capped, true, np.array([True, False, False, False]), 256)
    assert got["kendall_tau"] == 1.0  # over the uncensored three only
    assert got["censored_share"] == 0.25 and got["capped_auc"] == 1.0
    # expected lengths 255, 62, 60, 115 against 256, 30, 70, 90: one pair of six discordant
    assert got["expected_tau_with_cap_ties"] == pytest.approx(2 / 3)
    assert auc(np.zeros(4), np.array([True, False, False, False])) is None
