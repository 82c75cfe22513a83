"""bench/results/README.md indexes every file and folder in bench/results/, and nothing else.

Each table row starts with the entry's name in backticks (a folder's with a trailing `/`).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "README.md"
ROW_RE = re.compile(r"^\| `([^`]+)` \|")


def indexed_names() -> list[str]:
    """The first cell of every table row of the index, in order."""
    lines = INDEX.read_text(encoding="utf-8").splitlines()
    return [m.group(1) for line in lines if (m := ROW_RE.match(line))]


HISTORY = RESULTS / "history"  # earlier runs: baselines and superseded measurements


def _names(folder: Path, prefix: str = "") -> list[str]:
    return [prefix + p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if p != INDEX]


def entries() -> list[str]:
    """What lies directly under bench/results/ and under its history/ (as `history/NAME`),
    folders with a trailing `/`, less the index and the history folder itself."""
    top = [n for n in _names(RESULTS) if n != "history/"]
    return sorted(top + (_names(HISTORY, "history/") if HISTORY.is_dir() else []))


def test_earlier_runs_live_in_history() -> None:
    """A row marked *Earlier run* names a file under history/, and only those rows do."""
    lines = INDEX.read_text(encoding="utf-8").splitlines()
    for line in lines:
        if (m := ROW_RE.match(line)) is not None:
            earlier = "*Earlier run*" in line
            assert earlier == m.group(1).startswith("history/"), line[:160]


def test_index_lists_entries() -> None:
    assert len(indexed_names()) >= 5, f"{INDEX} has almost no rows: {indexed_names()}"


def test_every_entry_is_indexed() -> None:
    listed = set(indexed_names())
    missing = [e for e in entries() if e not in listed]
    assert not missing, f"in bench/results/ but not in its README.md: {missing}"


def test_every_indexed_name_exists() -> None:
    present = set(entries())
    stale = [n for n in indexed_names() if n not in present]
    assert not stale, f"in bench/results/README.md but not in bench/results/: {stale}"


def test_no_entry_is_indexed_twice() -> None:
    twice = sorted(n for n, k in Counter(indexed_names()).items() if k > 1)
    assert not twice, f"listed more than once in bench/results/README.md: {twice}"
