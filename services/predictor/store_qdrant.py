"""Length store on qdrant-client: a Qdrant server (`url=`) or the client's local mode (`path=`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.predictor.store_base import (
    LengthStore,
    Neighbor,
    Record,
    StoreUnavailable,
    neighbor_of,
    payload_of,
)


class QdrantClientStore(LengthStore):
    def __init__(
        self,
        dim: int,
        url: str | None = None,
        api_key: str | None = None,
        path: Path | None = None,
        timeout: float = 2.0,
    ) -> None:
        from qdrant_client import QdrantClient

        self.dim = dim
        self.backend = "server" if url else "local"
        if url:
            self.client = QdrantClient(
                url=url, api_key=api_key, timeout=timeout, check_compatibility=False
            )
        else:
            Path(path).mkdir(parents=True, exist_ok=True)
            self.client = QdrantClient(path=str(path))
        self._known: set[str] = set()
        self._lock = threading.Lock()  # local mode is not thread-safe

    def _call(self, fn, *args, **kwargs):
        try:
            with self._lock:
                return fn(*args, **kwargs)
        except (ValueError, KeyError):
            raise
        except Exception as exc:
            raise StoreUnavailable(f"qdrant: {type(exc).__name__}: {exc}") from exc

    def _ensure(self, model: str) -> str:
        from qdrant_client import models

        name = self.collection(model)
        if name in self._known:
            return name
        if not self._call(self.client.collection_exists, name):
            try:
                self._call(
                    self.client.create_collection,
                    name,
                    vectors_config=models.VectorParams(
                        size=self.dim, distance=models.Distance.COSINE
                    ),
                )
            except StoreUnavailable:
                if not self._call(self.client.collection_exists, name):  # lost a create race
                    raise
        self._known.add(name)
        return name

    def search(self, model: str, vectors: np.ndarray, k: int) -> list[list[Neighbor]]:
        from qdrant_client import models

        name = self._ensure(model)
        requests = [
            models.QueryRequest(query=v.tolist(), limit=k, with_payload=True) for v in vectors
        ]
        if not requests:
            return []
        results = self._call(self.client.query_batch_points, name, requests=requests)
        return [[neighbor_of(p.id, p.score, p.payload) for p in r.points] for r in results]

    def upsert(self, model: str, records: Sequence[Record]) -> None:
        from qdrant_client import models

        name = self._ensure(model)
        for r in records:
            if r.vector is None:
                self._call(
                    self.client.set_payload,
                    name,
                    payload=payload_of(model, r),
                    points=[r.id],
                    wait=True,
                )
        points = [
            models.PointStruct(
                id=r.id, vector=np.asarray(r.vector).tolist(), payload=payload_of(model, r)
            )
            for r in records
            if r.vector is not None
        ]
        for start in range(0, len(points), 1024):
            self._call(self.client.upsert, name, points=points[start : start + 1024], wait=True)

    def count(self, model: str) -> int:
        name = self._ensure(model)
        return int(self._call(self.client.count, name, exact=True).count)

    def oldest(self, model: str, n: int) -> list[str]:
        name = self._ensure(model)
        rows, offset = [], None
        while True:
            page, offset = self._call(
                self.client.scroll,
                name,
                limit=4096,
                offset=offset,
                with_payload=["time"],
                with_vectors=False,
            )
            rows.extend((p.payload.get("time", 0.0), str(p.id)) for p in page)
            if offset is None:
                break
        return [pid for _, pid in sorted(rows)[:n]]

    def delete(self, model: str, ids: Sequence[str]) -> None:
        from qdrant_client import models

        if ids:
            name = self._ensure(model)
            self._call(
                self.client.delete,
                name,
                points_selector=models.PointIdsList(points=list(ids)),
                wait=True,
            )

    def close(self) -> None:
        self.client.close()
