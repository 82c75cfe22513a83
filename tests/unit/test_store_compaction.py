"""Qdrant Edge store compaction: evicted and rewritten points stop costing files and memory,
writes made during a copy are kept, and a reopened store finds the newest ready generation."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import numpy as np

from services.predictor import store_edge
from services.predictor.store_base import Record, point_id
from services.predictor.store_edge import EdgeStore

DIM = 32


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())  # allocated


def _churn(store: EdgeStore, rng: np.random.Generator, inserts: int, capacity: int) -> None:
    for i, v in enumerate(_unit(rng, inserts)):
        store.upsert("m", [Record(str(uuid.uuid4()), v, 10.0, 1, [f"r{i}"], 1000.0 + i)])
        store.evict_if_full("m", capacity)


def _wait_idle(store: EdgeStore) -> None:
    for thread in list(store._compactor.values()):
        thread.join()


def test_compaction_bounds_the_files_under_eviction(tmp_path, monkeypatch):
    monkeypatch.setattr(store_edge, "COMPACT_MIN_DEAD", 100)
    sizes = {}
    for compact in (False, True):
        root = tmp_path / str(compact)
        store = EdgeStore(DIM, root, compact=compact)
        _churn(store, np.random.default_rng(0), inserts=3000, capacity=200)
        _wait_idle(store)
        store.flush()
        sizes[compact] = _disk_bytes(root)
        assert 190 <= store.count("m") <= 200  # eviction as before (5% slack)
        if compact:
            assert store.compactions >= 5
            names = sorted(p.name for p in root.iterdir())
            assert len(names) == 2 and names[1] == names[0] + ".ready"  # one generation left
        store.close()
    # 15 capacities of churn: without compaction the files keep every evicted point
    assert sizes[True] < sizes[False] / 3, sizes


def test_writes_during_a_copy_are_kept(tmp_path):
    rng = np.random.default_rng(1)
    store = EdgeStore(DIM, tmp_path, compact=False)
    vecs = _unit(rng, 3000)
    ids = [point_id("m", str(i)) for i in range(len(vecs))]
    store.upsert("m", [Record(ids[i], vecs[i], float(i), time=1.0) for i in range(2000)])
    expect = {ids[i]: float(i) for i in range(2000)}
    stop = threading.Event()

    def writer() -> None:  # new points, payload rewrites and deletes, until the swap is done
        i = 2000
        while not stop.is_set() and i < len(vecs):
            store.upsert("m", [Record(ids[i], vecs[i], float(i), time=2.0)])
            expect[ids[i]] = float(i)
            old = ids[i - 2000]
            if i % 2:
                store.upsert("m", [Record(old, None, -1.0, 2, time=3.0)])
                expect[old] = -1.0
            else:
                store.delete("m", [old])
                expect.pop(old)
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        store.compact_now("m")
    finally:
        stop.set()
        thread.join()
    assert store.compactions == 1 and store.replayed > 0  # some writes landed mid-copy
    assert store.count("m") == len(expect)
    for pid in rng.choice(list(expect), size=50, replace=False):
        vec = vecs[ids.index(pid)]
        top = store.search("m", vec[None], k=1)[0][0]
        assert (top.id, top.length) == (pid, expect[pid])
    store.close()


def test_reopen_loads_the_newest_ready_generation(tmp_path):
    rng = np.random.default_rng(2)
    vecs = _unit(rng, 50)
    store = EdgeStore(DIM, tmp_path)
    store.upsert("m", [Record(point_id("m", str(i)), v, float(i)) for i, v in enumerate(vecs)])
    store.compact_now("m")
    store.compact_now("m")
    name = store.collection("m")
    store.close()
    # an interrupted copy (no ready mark) is discarded on open
    (tmp_path / f"{name}.g7" / "segments").mkdir(parents=True)
    again = EdgeStore(DIM, tmp_path)
    assert again.count("m") == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.g2", f"{name}.g2.ready"]
    top = again.search("m", vecs[7:8], k=1)[0][0]
    assert (top.id, top.length) == (point_id("m", "7"), 7.0)
    again.close()


def test_searches_run_while_a_compaction_swaps(tmp_path):
    rng = np.random.default_rng(3)
    vecs = _unit(rng, 1500)
    store = EdgeStore(DIM, tmp_path, compact=False)
    store.upsert("m", [Record(point_id("m", str(i)), v, float(i)) for i, v in enumerate(vecs)])
    errors: list[BaseException] = []
    stop = threading.Event()

    def searcher() -> None:
        while not stop.is_set():
            try:
                i = int(rng.integers(len(vecs)))
                assert store.search("m", vecs[i : i + 1], k=1)[0][0].length == float(i)
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=searcher) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            store.compact_now("m")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert store.compactions == 3
    store.close()


def test_no_compaction_before_dead_writes_reach_the_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(store_edge, "COMPACT_MIN_DEAD", 10)
    rng = np.random.default_rng(4)
    store = EdgeStore(DIM, tmp_path)
    vecs = _unit(rng, 100)
    ids = [point_id("m", str(i)) for i in range(100)]
    store.upsert("m", [Record(pid, v, 1.0) for pid, v in zip(ids, vecs)])  # new points: not dead
    store.delete("m", ids[:20])  # 20 dead, under half of the 80 live
    _wait_idle(store)
    assert store.compactions == 0
    store.upsert("m", [Record(pid, None, 2.0) for pid in ids[20:39]])  # 39 dead
    _wait_idle(store)
    assert store.compactions == 0
    store.upsert("m", [Record(ids[39], None, 2.0)])  # 40 dead: half the live points
    _wait_idle(store)
    assert store.compactions == 1 and store.count("m") == 80
    assert store.search("m", vecs[30:31], k=1)[0][0].length == 2.0
    store.close()
