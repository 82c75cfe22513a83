"""What `alise predictor eval` (reference target) and `served_eval` (served target) share:
the chat formatting of prompts, a temporary store seeded with fit vectors, batched search and
the per-method predictions (prior, MLP, retrieval, ours)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.predictor.core import combine, decide

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings
    from services.predictor.store_base import LengthStore
    from services.predictor.store_edge import EdgeStore


def chat_formatter(settings: PredictorSettings) -> Callable[[str], str]:
    from services.common.models import load_tokenizer

    tok = load_tokenizer(settings.model, settings.data_dir)
    return lambda text: tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def seeded_store(
    dim: int,
    model: str,
    root: Path,
    vectors: np.ndarray,
    lengths: np.ndarray,
    censored: np.ndarray | None = None,
) -> EdgeStore:
    """A temporary Qdrant Edge store under `root` holding `vectors` [N, D] with their lengths
    (and censored flags)."""
    from services.predictor.store_base import Record, point_id
    from services.predictor.store_edge import EdgeStore

    store = EdgeStore(dim, root)
    capped = np.zeros(len(lengths)) if censored is None else np.asarray(censored, np.float64)
    store.upsert(
        model,
        [
            Record(point_id(model, str(i)), v, float(n), capped=float(c))
            for i, (v, n, c) in enumerate(zip(vectors, lengths, capped))
        ],
    )
    store.optimize(model)
    return store


def search_all(store: LengthStore, model: str, vectors: np.ndarray, k: int) -> list:
    return [
        n
        for start in range(0, len(vectors), 256)
        for n in store.search(model, vectors[start : start + 256], k)
    ]


def predictions(
    neighbors: list,
    mlp_pred: np.ndarray,
    prior: float,
    s0: float,
    n: int,
    mlp_capped: np.ndarray | None = None,
) -> tuple[dict, dict, dict]:
    """(lengths, hit rates, p_capped) per method, from each prompt's neighbours and the
    MLP's outputs."""
    mlp_capped = np.zeros(n) if mlp_capped is None else mlp_capped
    ours = [decide(nb, (m, c), prior, s0) for nb, m, c in zip(neighbors, mlp_pred, mlp_capped)]
    retrieval = [combine(nb, -1.0) for nb in neighbors]
    preds = {
        "prior": np.full(n, round(prior)),
        "mlp": np.maximum(np.round(mlp_pred), 1),
        "retrieval": np.array([max(1, round(r[0])) if r else round(prior) for r in retrieval]),
        "ours": np.array([p.length for p in ours]),
    }
    hits = {
        "prior": 0.0,
        "mlp": 0.0,
        "retrieval": float(np.mean([r is not None for r in retrieval])),
        "ours": float(np.mean([p.source == "retrieval" for p in ours])),
    }
    capped = {
        "prior": np.zeros(n),
        "mlp": np.asarray(mlp_capped, np.float64),
        "retrieval": np.array([r[2] if r else 0.0 for r in retrieval]),
        "ours": np.array([p.p_capped for p in ours]),
    }
    return preds, hits, capped
