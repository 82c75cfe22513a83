"""`alise bench store-churn`: does the embedded store (Qdrant Edge) give back what eviction frees?

In this process, per mode, a fresh `EdgeStore` seeded with `--seed-points` random unit vectors
(and optimized, as after the service's seed), then `--inserts` new points one at a time, each
after the searches a request makes (Predict's, then Observe's). Modes: `evict` (what the
service does: the oldest points go past `--capacity`, and the shard is compacted once the dead
points reach half the live ones), `no-compact` (evicting, never compacting: what the store did
before compaction), `grow` (no capacity: every point stays) and `optimize` (evicting without
compaction, plus Qdrant's own `optimize()` every `--optimize-every` inserts). Every
`--report-every` inserts, after `malloc_trim` (so freed heap does not count), it records the
live points, the number of segments and the process's resident memory: anonymous, and the
pages of the store's files.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from lab.workload.report import emit_json
from services.common import heap

MODEL = "churn"


def resident_mib(store_root: Path) -> dict[str, float]:
    """This process's resident MiB: `rss`, `anon` and `store_file` (pages of the store's files)."""
    out = dict.fromkeys(("rss", "anon", "store_file"), 0)
    path = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if not parts[0].endswith(":"):
            path = parts[5] if len(parts) > 5 else ""
        elif parts[0] == "Rss:":
            out["rss"] += int(parts[1])
            out["store_file"] += int(parts[1]) if path.startswith(str(store_root)) else 0
        elif parts[0] == "Anonymous:":
            out["anon"] += int(parts[1])
    return {k: round(v / 1024, 2) for k, v in out.items()}


def disk_mib(root: Path) -> float:
    """Allocated size of the store's files (their mapped size is mostly unallocated)."""
    return round(sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file()) / 2**20, 2)


def churn(args: argparse.Namespace, mode: str, root: Path) -> list[dict]:
    from services.predictor.store_base import Record
    from services.predictor.store_edge import EdgeStore

    rng = np.random.default_rng(args.seed)

    def unit(n: int) -> np.ndarray:
        v = rng.standard_normal((n, args.dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    store = EdgeStore(args.dim, root, compact=mode in ("evict", "grow"))
    now = time.time()
    seed = [
        Record(str(uuid.uuid4()), v, 10.0, 1, [f"s{i}"], now)
        for i, v in enumerate(unit(args.seed_points))
    ]
    store.upsert(MODEL, seed)
    store.optimize(MODEL)
    heap.trim()
    rows = [
        {"inserts": 0, "points": store.count(MODEL), "disk": disk_mib(root)} | resident_mib(root)
    ]
    for i in range(args.inserts):
        v = unit(1)
        store.search(MODEL, v, 2)  # Predict's search, then Observe's
        store.search(MODEL, v, 1)
        store.upsert(MODEL, [Record(str(uuid.uuid4()), v[0], 10.0, 1, [f"r{i}"], time.time())])
        if mode != "grow":
            store.evict_if_full(MODEL, args.capacity)
        if mode == "optimize" and (i + 1) % args.optimize_every == 0:
            store.optimize(MODEL)
        if (i + 1) % args.report_every == 0:
            heap.trim()
            segments = len(list((store.shard_path(MODEL) / "segments").iterdir()))
            rows.append(
                {"inserts": i + 1, "points": store.count(MODEL), "segments": segments}
                | {"compactions": store.compactions, "disk": disk_mib(root)}
                | resident_mib(root)
            )
    store.close()
    return rows


def per_insert(rows: list[dict]) -> dict[str, float]:
    first, last = rows[0], rows[-1]
    return {
        f"{k}_kib_per_insert": round((last[k] - first[k]) * 1024 / max(1, last["inserts"]), 2)
        for k in ("rss", "anon", "store_file", "disk")
    }


def _run(args: argparse.Namespace) -> int:
    out: dict = {
        k: getattr(args, k)
        for k in ("seed_points", "capacity", "inserts", "optimize_every", "report_every", "dim")
    }
    out["modes"] = {}
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="alise-bench-churn-") as tmp:
            rows = churn(args, mode, Path(tmp))
        out["modes"][mode] = {**per_insert(rows), "rows": rows}
    emit_json(out, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "store-churn", help="embedded store under inserts and eviction: what stays resident"
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("evict", "no-compact", "grow", "optimize"),
        default=["evict", "no-compact", "grow", "optimize"],
    )
    p.add_argument("--seed-points", type=int, default=2000)
    p.add_argument("--capacity", type=int, default=2500, help="evict past this (mode evict)")
    p.add_argument("--inserts", type=int, default=16000)
    p.add_argument("--optimize-every", type=int, default=2000)
    p.add_argument("--report-every", type=int, default=2000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    p.set_defaults(func=_run)
