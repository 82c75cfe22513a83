"""Length store on Qdrant Edge (`qdrant-edge-py`): in-process shards with an HNSW index.

One shard directory per serving model under `root/<collection>/`. The shard keeps a
write-ahead log, so upserts survive a crash; `flush()` also writes segments out.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.predictor.store_base import LengthStore, Neighbor, Record, neighbor_of, payload_of

HNSW_M = 16
HNSW_EF_CONSTRUCT = 100
FULL_SCAN_THRESHOLD_KB = 1000  # smaller segments are searched exactly
INDEXING_THRESHOLD_KB = 2000  # segments past this get an HNSW index


class EdgeStore(LengthStore):
    backend = "edge"

    def __init__(self, dim: int, root: Path, hnsw_ef: int = 64) -> None:
        self.dim = dim
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hnsw_ef = hnsw_ef
        self._shards: dict[str, object] = {}
        self._lock = threading.Lock()

    def _config(self):
        from qdrant_edge import (
            Distance,
            EdgeConfig,
            EdgeOptimizersConfig,
            EdgeVectorParams,
            HnswIndexConfig,
        )

        return EdgeConfig(
            vectors=EdgeVectorParams(size=self.dim, distance=Distance.Cosine),
            hnsw_config=HnswIndexConfig(
                m=HNSW_M, ef_construct=HNSW_EF_CONSTRUCT, full_scan_threshold=FULL_SCAN_THRESHOLD_KB
            ),
            optimizers=EdgeOptimizersConfig(indexing_threshold=INDEXING_THRESHOLD_KB),
        )

    def _shard(self, model: str):
        from qdrant_edge import EdgeShard

        name = self.collection(model)
        shard = self._shards.get(name)
        if shard is None:
            with self._lock:
                shard = self._shards.get(name)
                if shard is None:
                    path = self.root / name
                    exists = path.exists() and any(path.iterdir())
                    shard = (
                        EdgeShard.load(str(path))
                        if exists
                        else EdgeShard.create(str(path), self._config())
                    )
                    self._shards[name] = shard
        return shard

    def search(self, model: str, vectors: np.ndarray, k: int) -> list[list[Neighbor]]:
        from qdrant_edge import Query, QueryBatchRequest, QueryRequest, SearchParams

        if len(vectors) == 0:
            return []
        params = SearchParams(hnsw_ef=max(self.hnsw_ef, k))
        requests = [
            QueryRequest(limit=k, query=Query.Nearest(v.tolist()), with_payload=True, params=params)
            for v in vectors
        ]
        results = self._shard(model).query_batch(QueryBatchRequest(requests))
        return [[neighbor_of(p.id, p.score, p.payload) for p in r] for r in results]

    def upsert(self, model: str, records: Sequence[Record]) -> None:
        from qdrant_edge import Point, UpdateOperation

        shard = self._shard(model)
        for r in records:
            if r.vector is None:
                shard.update(UpdateOperation.set_payload([r.id], payload_of(model, r)))
        points = [
            Point(r.id, np.asarray(r.vector).tolist(), payload_of(model, r))
            for r in records
            if r.vector is not None
        ]
        for start in range(0, len(points), 1024):
            shard.update(UpdateOperation.upsert_points(points[start : start + 1024]))

    def count(self, model: str) -> int:
        from qdrant_edge import CountRequest

        return int(self._shard(model).count(CountRequest(exact=True)))

    def oldest(self, model: str, n: int) -> list[str]:
        from qdrant_edge import ScrollRequest

        shard, rows, offset = self._shard(model), [], None
        while True:
            page, offset = shard.scroll(
                ScrollRequest(offset=offset, limit=4096, with_payload=["time"], with_vector=False)
            )
            rows.extend(((p.payload or {}).get("time", 0.0), str(p.id)) for p in page)
            if offset is None:
                break
        return [pid for _, pid in sorted(rows)[:n]]

    def delete(self, model: str, ids: Sequence[str]) -> None:
        from qdrant_edge import UpdateOperation

        if ids:
            self._shard(model).update(UpdateOperation.delete_points(list(ids)))

    def optimize(self, model: str) -> None:
        self._shard(model).optimize()

    def flush(self) -> None:
        for shard in list(self._shards.values()):
            shard.flush()

    def close(self) -> None:
        with self._lock:
            for shard in self._shards.values():
                shard.flush()
                shard.close()
            self._shards.clear()
