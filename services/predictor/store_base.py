"""The length store's interface: one vector collection per serving model, on Qdrant.

A point is (prompt embedding, payload {length, count, capped, spread, model, time, rids}). `count` is
how many true output lengths were merged into the point, `capped` the share of them cut by
`max_tokens` (censored), and `length` the running mean of those that ended on their own
(`services.common.censoring`), `spread` the spread of the seed's draws of its prompt
(`services.predictor.regimes`; observations do not change it); `rids`
holds the last request ids merged in, so a repeated Observe is recognised in the store itself
(replicas share nothing else). Growth is bounded: an observation within `merge_similarity` of
an existing point updates that point's running mean instead of adding one, and past
`capacity` the oldest points are evicted.

This module holds the interface and the types every backend shares; `store.py` picks a
backend.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_RIDS = 16  # request ids remembered per point (idempotent Observe)
EVICT_FRACTION = 0.05  # share of capacity freed per eviction pass


@dataclass(frozen=True)
class Neighbor:
    id: str
    score: float  # cosine similarity
    length: float  # running mean of the merged lengths that ended on their own
    count: int = 1
    rids: tuple[str, ...] = ()
    capped: float = 0.0  # share of the merged lengths cut by max_tokens
    spread: float = 0.0  # std of log1p(length) over the seed's draws (0: unknown)


@dataclass
class Record:
    """A point to write."""

    id: str
    vector: np.ndarray | None  # [D]; None = update the payload of an existing point
    length: float
    count: int = 1
    rids: list[str] = field(default_factory=list)
    time: float = 0.0
    capped: float = 0.0
    spread: float = 0.0


class StoreUnavailable(RuntimeError):
    """The vector store could not be reached (Predict falls back to the MLP)."""


def collection_name(model: str, space: str = "") -> str:
    """One collection per serving model id and embedding space (Qdrant-safe characters):
    vectors from another embedder configuration are never compared with these."""
    name = "lengths_" + re.sub(r"[^A-Za-z0-9_-]", "_", model)
    return name + ("__" + re.sub(r"[^A-Za-z0-9_-]", "_", space) if space else "")


def point_id(model: str, key: str) -> str:
    """Deterministic point id for a request id (or any key) within a model."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"alise:{model}:{key}"))


def payload_of(model: str, rec: Record) -> dict[str, Any]:
    return {
        "length": float(rec.length),
        "count": int(rec.count),
        "capped": float(rec.capped),
        "spread": float(rec.spread),
        "model": model,
        "time": float(rec.time or time.time()),
        "rids": list(rec.rids[-MAX_RIDS:]),
    }


def neighbor_of(pid: object, score: float, payload: dict[str, Any] | None) -> Neighbor:
    payload = payload or {}
    return Neighbor(
        str(pid),
        float(score),
        float(payload.get("length", 0.0)),
        int(payload.get("count", 1)),
        tuple(payload.get("rids", ())),
        float(payload.get("capped", 0.0)),
        float(payload.get("spread", 0.0)),
    )


class LengthStore:
    """Interface every backend implements (all methods are blocking)."""

    backend = "abstract"
    space = ""  # embedding space id (Embedder.space); part of every collection name
    compactions = 0  # shard compactions so far (backends that compact count them)

    def collection(self, model: str) -> str:
        return collection_name(model, self.space)

    def search(self, model: str, vectors: np.ndarray, k: int) -> list[list[Neighbor]]:
        """Top-k neighbours of each row of `vectors` [N, D], best first."""
        raise NotImplementedError

    def upsert(self, model: str, records: Sequence[Record]) -> None:
        """Write points; records without a vector only replace an existing point's payload."""
        raise NotImplementedError

    def count(self, model: str) -> int:
        raise NotImplementedError

    def oldest(self, model: str, n: int) -> list[str]:
        """Ids of the `n` points with the smallest `time`."""
        raise NotImplementedError

    def delete(self, model: str, ids: Sequence[str]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make writes durable (no-op where the backend already is)."""

    def close(self) -> None:
        """Release files and connections."""

    def optimize(self, model: str) -> None:
        """Build indexes after a bulk load (no-op where the backend does it itself)."""

    def evict_if_full(self, model: str, capacity: int) -> int:
        """Delete the oldest points beyond `capacity` (plus slack); returns how many."""
        size = self.count(model)
        if size <= capacity:
            return 0
        n = size - capacity + int(capacity * EVICT_FRACTION)
        ids = self.oldest(model, min(n, size))
        self.delete(model, ids)
        return len(ids)
