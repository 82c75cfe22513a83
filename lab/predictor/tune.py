"""Choose k and s0 on a validation part of the train split (never on the test split).

Every 10th train sample is held out; the rest is the database and trains the MLP. Neighbours
come from an exact dot-product search (the embeddings are unit vectors). Reports Kendall tau
and mean relative error of Algorithm 1 for each (k, s0), and the pair with the best tau.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import numpy as np

from lab.predictor.metrics_eval import accuracy
from services.predictor.core import decide
from services.predictor.store_base import Neighbor

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings

KS = (1, 2, 4, 8, 16, 32)
THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def exact_topk(
    queries: np.ndarray, base: np.ndarray, lengths: np.ndarray, k: int
) -> list[list[Neighbor]]:
    scores = queries @ base.T  # [Q, N]
    top = np.argpartition(-scores, k, axis=1)[:, :k]  # [Q, k] unordered
    out = []
    for row, idx in zip(scores, top):
        idx = idx[np.argsort(-row[idx])]
        out.append([Neighbor(str(i), float(row[i]), float(lengths[i])) for i in idx])
    return out


def sweep(settings: PredictorSettings, args: argparse.Namespace) -> dict:
    from services.predictor.build import embedding_cache, make_embedder, train_samples
    from services.predictor.mlp import length_feature, train

    embedder = make_embedder(settings, normalize=args.text == "norm")
    samples = train_samples(settings, args.limit_train)
    prompts = [s.prompt for s in samples]
    x = embedding_cache(settings, embedder).embed(prompts)  # [N, D]
    f = length_feature(embedder.prepare(prompts))
    y = np.array([s.output_len for s in samples], np.float32)
    val = np.arange(len(samples)) % 10 == 0
    mlp = train(x[~val], f[~val], y[~val], log=None)
    mlp_pred = mlp.predict(x[val], f[val])
    prior = float(y[~val].mean())
    neighbors = exact_topk(x[val], x[~val], y[~val], max(KS))
    rows = []
    for k in KS:
        for s0 in THRESHOLDS:
            preds = [decide(n[:k], (m, 0.0), prior, s0) for n, m in zip(neighbors, mlp_pred)]
            acc = accuracy(np.array([p.length for p in preds]), y[val])
            rows.append(
                {
                    "k": k,
                    "s0": s0,
                    "kendall_tau": round(acc["kendall_tau"], 4),
                    "mean_relative_error": round(acc["mean_relative_error"], 4),
                    "hit_rate": round(float(np.mean([p.source == "retrieval" for p in preds])), 4),
                }
            )
    mlp_acc = accuracy(np.round(mlp_pred), y[val])
    best = max(rows, key=lambda r: r["kendall_tau"])
    return {
        "validation": int(val.sum()),
        "mlp_kendall_tau": round(mlp_acc["kendall_tau"], 4),
        "mlp_mean_relative_error": round(mlp_acc["mean_relative_error"], 4),
        "best_by_tau": best,
        "grid": rows,
    }
