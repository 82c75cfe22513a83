"""`alise predictor bench-store`: embedded backends side by side (qdrant-client local vs Edge).

Loads N vectors (cached train-split embeddings when present, else random unit vectors),
then times single-vector and batch-32 top-k queries and measures Edge's recall against the
exact (brute-force) neighbours of local mode. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from services.predictor.store_base import LengthStore, Record, point_id


def _vectors(n: int, dim: int, cache: Path | None) -> tuple[np.ndarray, str]:
    """[n, dim] unit vectors: real prompt embeddings, padded with jittered copies of them
    when the cache holds fewer; random ones when there is no cache."""
    rng = np.random.default_rng(0)
    if cache and cache.exists():
        data = np.load(cache)["vectors"].astype(np.float32)
        data, kind = data[rng.permutation(len(data))], "prompt embeddings"
        if len(data) < n:
            kind += f" + {n - len(data)} jittered copies"
            extra = data[rng.integers(0, len(data), n - len(data))]
            extra = extra + rng.standard_normal(extra.shape).astype(np.float32) * 0.02
            data = np.concatenate([data, extra])
        v = data[:n]
    else:
        v, kind = rng.standard_normal((n, dim)).astype(np.float32), "random"
    return v / np.linalg.norm(v, axis=1, keepdims=True), kind


def _time_store(store: LengthStore, vectors: np.ndarray, queries: np.ndarray, k: int) -> dict:
    t0 = time.perf_counter()
    store.upsert(
        "bench", [Record(point_id("bench", str(i)), v, float(i)) for i, v in enumerate(vectors)]
    )
    store.optimize("bench")
    load_s = time.perf_counter() - t0
    singles = []
    for q in queries:
        t = time.perf_counter()
        store.search("bench", q[None], k)
        singles.append(time.perf_counter() - t)
    t = time.perf_counter()
    for start in range(0, len(queries), 32):
        store.search("bench", queries[start : start + 32], k)
    batch_s = time.perf_counter() - t
    ms = np.array(singles) * 1000
    return {
        "load_s": round(load_s, 2),
        "single_p50_ms": round(float(np.median(ms)), 3),
        "single_p99_ms": round(float(np.percentile(ms, 99)), 3),
        "batch32_queries_per_s": round(len(queries) / batch_s, 1),
    }


def run(n: int, k: int, n_queries: int, cache: Path | None) -> dict:
    from services.predictor.store_edge import EdgeStore
    from services.predictor.store_qdrant import QdrantClientStore

    data, kind = _vectors(n + n_queries, 384, cache)
    vectors, queries = data[n_queries:], data[:n_queries]  # queries: real when any are
    out: dict = {"points": n, "k": k, "queries": n_queries, "vectors": kind}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, store in (
            ("local", QdrantClientStore(384, path=Path(tmp) / "local")),
            ("edge", EdgeStore(384, Path(tmp) / "edge")),
        ):
            out[name] = _time_store(store, vectors, queries, k)
            results[name] = [[nb.score for nb in r] for r in store.search("bench", queries, k)]
            store.close()
    # Recall by score (ties among duplicate prompts make id overlap misleading): the share
    # of Edge's k results scoring at least the exact k-th best score.
    recall = np.mean(
        [np.sum(np.array(b) >= a[-1] - 1e-5) / k for a, b in zip(results["local"], results["edge"])]
    )
    out["edge_recall_vs_exact"] = round(float(recall), 4)
    return out


def main(args: argparse.Namespace) -> int:
    from services.common.settings import PredictorSettings

    cache = args.vectors or next(
        iter(
            sorted((Path(PredictorSettings().data_dir) / "predictor" / "embeddings").glob("*.npz"))
        ),
        None,
    )
    print(json.dumps(run(args.points, args.k, args.queries, cache), indent=1))
    return 0
