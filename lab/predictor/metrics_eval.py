"""Accuracy figures of a length predictor (one definition for eval, docs and tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

BUCKET_TOKENS = 128
NUM_BUCKETS = 8  # [0,128) ... [768,896) and the open-ended [896, inf)


def buckets(lengths: np.ndarray) -> np.ndarray:
    return np.minimum(np.asarray(lengths) // BUCKET_TOKENS, NUM_BUCKETS - 1)


def _rank_corr(
    fn: Callable[[np.ndarray, np.ndarray], Sequence[float]], pred: np.ndarray, true: np.ndarray
) -> float:
    """A rank correlation; 0.0 for a constant prediction (it carries no ranking)."""
    if np.ptp(pred) == 0:
        return 0.0
    return float(fn(pred, true)[0])


def accuracy(pred: np.ndarray, true: np.ndarray) -> dict:
    from scipy.stats import kendalltau, spearmanr

    pred, true = np.asarray(pred, np.float64), np.asarray(true, np.float64)
    return {
        "bucket_accuracy": float(np.mean(buckets(pred) == buckets(true))),
        "mean_relative_error": float(np.mean(np.abs(pred - true) / true)),
        "mae": float(np.mean(np.abs(pred - true))),
        "kendall_tau": _rank_corr(kendalltau, pred, true),
        "spearman": _rank_corr(spearmanr, pred, true),
    }


def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """Area under the ROC curve of `score` for `label` (None: one class, or a constant score)."""
    from scipy.stats import rankdata

    pos, n = int(label.sum()), len(label)
    if pos in (0, n) or np.ptp(score) == 0:
        return None
    ranks = rankdata(score)
    return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * (n - pos)))
