"""Length store on Qdrant Edge (`qdrant-edge-py`): in-process shards with an HNSW index.

One shard per serving model under `root/`. The shard keeps a write-ahead log, so upserts
survive a crash; `flush()` also writes segments out.

Compaction. Qdrant Edge keeps the pages of deleted and rewritten points in its files (and so
in memory: they are mapped), and its `optimize()` does not give them back either. So once the
dead writes since a shard was made (evicted points, payload rewrites of merged points) reach
half its live points, a background thread copies the live points into a fresh shard (a new
generation directory `root/<collection>.g<N>`), indexes it, replays the writes made meanwhile,
marks it ready and swaps it in; the old shard is closed once no search holds it and its
directory removed. Searches and writes never wait for the copy. On open, the newest ready
generation is loaded and anything else (an interrupted copy, a generation not yet removed)
deleted. The files then stay within about 1.5× what the live points need.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.predictor.store_base import LengthStore, Neighbor, Record, neighbor_of, payload_of

log = logging.getLogger(__name__)

HNSW_M = 16
HNSW_EF_CONSTRUCT = 100
FULL_SCAN_THRESHOLD_KB = 1000  # smaller segments are searched exactly
INDEXING_THRESHOLD_KB = 2000  # segments past this get an HNSW index
COMPACT_MIN_DEAD = 1000  # dead writes before a compaction is considered ...
COMPACT_DEAD_SHARE = 0.5  # ... and at least this share of the live points
COPY_PAGE = 1024


def _copy_points(source, target) -> None:
    """Every live point of shard `source` (vector and payload) into shard `target`."""
    from qdrant_edge import Point, ScrollRequest, UpdateOperation

    offset = None
    while True:
        page, offset = source.scroll(
            ScrollRequest(offset=offset, limit=COPY_PAGE, with_payload=True, with_vector=True)
        )
        if page:
            target.update(
                UpdateOperation.upsert_points([Point(p.id, p.vector, p.payload) for p in page])
            )
        if offset is None:
            return


@dataclass(eq=False)
class _Generation:
    """One open shard directory and how many calls are using it."""

    shard: object
    path: Path
    number: int
    users: int = 0


class EdgeStore(LengthStore):
    backend = "edge"

    def __init__(self, dim: int, root: Path, hnsw_ef: int = 64, compact: bool = True) -> None:
        self.dim = dim
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hnsw_ef = hnsw_ef
        self.compact = compact
        self.compactions = 0  # finished, over all collections
        self.replayed = 0  # writes made during a copy and replayed into its result
        self._open: dict[str, _Generation] = {}
        self._cond = threading.Condition()  # guards _open and the users counts
        self._write_locks: dict[str, threading.Lock] = {}
        self._dead: dict[str, int] = {}  # dead writes since the generation was made
        self._check_at: dict[str, int] = {}
        self._journal: dict[str, list] = {}  # writes made while a copy runs
        self._compactor: dict[str, threading.Thread] = {}

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

    # -- generations on disk -------------------------------------------------------------

    def _path(self, name: str, number: int) -> Path:
        return self.root / (name if number == 0 else f"{name}.g{number}")

    def _ready_mark(self, name: str, number: int) -> Path:
        return self.root / f"{name}.g{number}.ready"

    def _generations(self, name: str) -> list[int]:
        numbers = [0] if self._path(name, 0).exists() else []
        for p in self.root.glob(f"{name}.g*"):
            tail = p.name[len(name) + 2 :]
            if p.is_dir() and tail.isdigit():
                numbers.append(int(tail))
        return sorted(numbers)

    def _remove(self, name: str, number: int) -> None:
        shutil.rmtree(self._path(name, number), ignore_errors=True)
        self._ready_mark(name, number).unlink(missing_ok=True)

    def _load(self, name: str) -> _Generation:
        """The newest ready generation (or a new shard); other generations are removed."""
        from qdrant_edge import EdgeShard

        numbers = self._generations(name)
        ready = [n for n in numbers if n == 0 or self._ready_mark(name, n).exists()]
        number = ready[-1] if ready else 0
        for n in numbers:
            if n != number:
                self._remove(name, n)
        path = self._path(name, number)
        exists = path.exists() and any(path.iterdir())
        shard = EdgeShard.load(str(path)) if exists else EdgeShard.create(str(path), self._config())
        return _Generation(shard, path, number)

    @contextmanager
    def _use(self, model: str) -> Iterator[object]:
        """The collection's current shard, kept open while the block runs."""
        name = self.collection(model)
        with self._cond:
            gen = self._open.get(name)
            if gen is None:
                gen = self._open[name] = self._load(name)
                self._write_locks[name] = threading.Lock()
            gen.users += 1
        try:
            yield gen.shard
        finally:
            with self._cond:
                gen.users -= 1
                self._cond.notify_all()

    def shard_path(self, model: str) -> Path:
        """The directory of `model`'s current shard generation."""
        with self._use(model):
            return self._open[self.collection(model)].path

    def _write_lock(self, model: str) -> threading.Lock:
        with self._use(model):
            return self._write_locks[self.collection(model)]

    # -- the interface ---------------------------------------------------------------------

    def search(self, model: str, vectors: np.ndarray, k: int) -> list[list[Neighbor]]:
        from qdrant_edge import Query, QueryBatchRequest, QueryRequest, SearchParams

        if len(vectors) == 0:
            return []
        params = SearchParams(hnsw_ef=max(self.hnsw_ef, k))
        requests = [
            QueryRequest(limit=k, query=Query.Nearest(v.tolist()), with_payload=True, params=params)
            for v in vectors
        ]
        with self._use(model) as shard:
            results = shard.query_batch(QueryBatchRequest(requests))
        return [[neighbor_of(p.id, p.score, p.payload) for p in r] for r in results]

    def upsert(self, model: str, records: Sequence[Record]) -> None:
        from qdrant_edge import Point, UpdateOperation

        ops = [
            UpdateOperation.set_payload([r.id], payload_of(model, r))
            for r in records
            if r.vector is None
        ]
        points = [
            Point(r.id, np.asarray(r.vector).tolist(), payload_of(model, r))
            for r in records
            if r.vector is not None
        ]
        ops += [
            UpdateOperation.upsert_points(points[start : start + COPY_PAGE])
            for start in range(0, len(points), COPY_PAGE)
        ]
        self._write(model, ops, dead=len(records) - len(points))

    def count(self, model: str) -> int:
        from qdrant_edge import CountRequest

        with self._use(model) as shard:
            return int(shard.count(CountRequest(exact=True)))

    def oldest(self, model: str, n: int) -> list[str]:
        from qdrant_edge import ScrollRequest

        rows, offset = [], None
        with self._use(model) as shard:
            while True:
                page, offset = shard.scroll(
                    ScrollRequest(
                        offset=offset, limit=4096, with_payload=["time"], with_vector=False
                    )
                )
                rows.extend(((p.payload or {}).get("time", 0.0), str(p.id)) for p in page)
                if offset is None:
                    break
        return [pid for _, pid in sorted(rows)[:n]]

    def delete(self, model: str, ids: Sequence[str]) -> None:
        from qdrant_edge import UpdateOperation

        if ids:
            self._write(model, [UpdateOperation.delete_points(list(ids))], dead=len(ids))

    def optimize(self, model: str) -> None:
        with self._use(model) as shard:
            shard.optimize()

    def flush(self) -> None:
        with self._cond:
            gens = list(self._open.values())
        for gen in gens:
            gen.shard.flush()

    def close(self) -> None:
        for thread in list(self._compactor.values()):
            thread.join()
        with self._cond:
            self._cond.wait_for(lambda: all(g.users == 0 for g in self._open.values()))
            for gen in self._open.values():
                gen.shard.flush()
                gen.shard.close()
            self._open.clear()

    # -- writes and compaction -------------------------------------------------------------

    def _write(self, model: str, ops: list, dead: int) -> None:
        name = self.collection(model)
        with self._write_lock(model):
            with self._use(model) as shard:
                for op in ops:
                    shard.update(op)
            if name in self._journal:
                self._journal[name].extend(ops)
            self._dead[name] = self._dead.get(name, 0) + dead
            if self.compact and name not in self._compactor and self._compaction_due(model):
                self._journal[name] = []
                thread = threading.Thread(
                    target=self._compact, args=(model,), name=f"compact-{name}", daemon=True
                )
                self._compactor[name] = thread
                thread.start()

    def _compaction_due(self, model: str) -> bool:
        name = self.collection(model)
        dead = self._dead.get(name, 0)
        if dead < max(COMPACT_MIN_DEAD, self._check_at.get(name, 0)):
            return False
        live = self.count(model)
        if dead >= COMPACT_DEAD_SHARE * live:
            return True
        self._check_at[name] = int(COMPACT_DEAD_SHARE * live)  # no count() before then
        return False

    def compact_now(self, model: str) -> None:
        """Compact `model`'s shard in this thread (writes made meanwhile are kept)."""
        name = self.collection(model)
        while True:
            running = self._compactor.get(name)
            if running is not None:
                running.join()
            with self._write_lock(model):
                if name not in self._compactor:
                    self._journal[name] = []
                    self._compactor[name] = threading.current_thread()
                    break
        self._compact(model)

    def _compact(self, model: str) -> None:
        """Copy the live points into a new generation, then swap it in (see the module doc)."""
        from qdrant_edge import EdgeShard

        name = self.collection(model)
        new, number, started = None, -1, time.perf_counter()
        try:
            with self._cond:
                old = self._open[name]
                old.users += 1  # held open for the copy
            number = old.number + 1
            path = self._path(name, number)
            self._remove(name, number)
            new = EdgeShard.create(str(path), self._config())
            try:
                _copy_points(old.shard, new)
            finally:
                with self._cond:
                    old.users -= 1
                    self._cond.notify_all()
            new.optimize()
            with self._write_locks[name]:
                for op in self._journal.pop(name):
                    new.update(op)
                    self.replayed += 1
                new.flush()
                self._ready_mark(name, number).touch()
                with self._cond:
                    self._open[name] = _Generation(new, path, number)
                self._dead[name] = 0
                self._check_at.pop(name, None)
            new = None
            with self._cond:
                self._cond.wait_for(lambda: old.users == 0)
            old.shard.close()
            self._remove(name, old.number)
            self.compactions += 1
            log.info(
                "compacted the store",
                extra={
                    "collection": name,
                    "generation": number,
                    "seconds": round(time.perf_counter() - started, 2),
                },
            )
        except Exception:
            log.exception("compaction of %s failed; the current shard stays", name)
            self._journal.pop(name, None)
            if new is not None:
                new.close()
                self._remove(name, number)
        finally:
            self._compactor.pop(name, None)
