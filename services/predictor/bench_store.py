"""`alise predictor bench-store`: embedded backends side by side (qdrant-client local vs Edge).

Loads N vectors (cached train-split embeddings when present, else random unit vectors),
then times single-vector and batch-32 top-k queries and measures Edge's recall against the
exact (brute-force) neighbours of local mode. Prints one JSON object.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from services.predictor.store import Record, point_id


def _vectors(n: int, dim: int, cache: Path | None) -> np.ndarray:
    if cache and cache.exists():
        data = np.load(cache)["vectors"]
        if len(data) >= n:
            return data[:n].astype(np.float32)
    rng = np.random.default_rng(0)
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _time_store(store, vectors: np.ndarray, queries: np.ndarray, k: int) -> dict:
    t0 = time.perf_counter()
    store.upsert("bench", [Record(point_id("bench", str(i)), v, float(i))
                           for i, v in enumerate(vectors)])
    store.optimize("bench")
    load_s = time.perf_counter() - t0
    singles = []
    for q in queries:
        t = time.perf_counter()
        store.search("bench", q[None], k)
        singles.append(time.perf_counter() - t)
    t = time.perf_counter()
    for start in range(0, len(queries), 32):
        store.search("bench", queries[start:start + 32], k)
    batch_s = time.perf_counter() - t
    ms = np.array(singles) * 1000
    return {"load_s": round(load_s, 2), "single_p50_ms": round(float(np.median(ms)), 3),
            "single_p99_ms": round(float(np.percentile(ms, 99)), 3),
            "batch32_queries_per_s": round(len(queries) / batch_s, 1)}


def run(n: int, k: int, n_queries: int, cache: Path | None) -> dict:
    from services.predictor.store_edge import EdgeStore
    from services.predictor.store_qdrant import QdrantClientStore

    data = _vectors(n + n_queries, 384, cache)
    vectors, queries = data[:n], data[n:n + n_queries]
    out: dict = {"points": n, "k": k, "queries": n_queries}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, store in (("local", QdrantClientStore(384, path=Path(tmp) / "local")),
                            ("edge", EdgeStore(384, Path(tmp) / "edge"))):
            out[name] = _time_store(store, vectors, queries, k)
            results[name] = [[nb.id for nb in r] for r in store.search("bench", queries, k)]
            store.close()
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(results["local"], results["edge"])])
    out["edge_recall_vs_exact"] = round(float(recall), 4)
    return out


def main(args) -> int:
    from services.common.settings import PredictorSettings

    cache = args.vectors or next(
        iter(sorted((Path(PredictorSettings().data_dir) / "predictor" / "embeddings").glob(
            "*.npz"))), None)
    print(json.dumps(run(args.points, args.k, args.queries, cache), indent=1))
    return 0
