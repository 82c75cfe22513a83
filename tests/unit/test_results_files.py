"""The benchmark figures quoted in README.md and docs/*.md come with their run's output.

Every `bench/results/...` path a doc names exists in the repository and parses (JSON, or CSV
with a header), is not git-ignored, and every file in bench/results/ is named by some doc.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PATH_RE = re.compile(r"bench/results/[\w./-]*")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def named_paths() -> dict[str, list[str]]:
    """Each `bench/results/...` path named in the docs -> the docs naming it."""
    found: dict[str, list[str]] = {}
    for doc in _docs():
        for match in PATH_RE.finditer(doc.read_text(encoding="utf-8")):
            path = match.group(0).rstrip(".")
            found.setdefault(path, []).append(doc.name)
    return found


def _files_in_results() -> list[str]:
    """The result files: everything under bench/results/ but its index, README.md."""
    index = RESULTS / "README.md"
    return sorted(
        p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != index
    )


def test_docs_name_result_files() -> None:
    files = [p for p in named_paths() if not p.endswith("/")]
    assert len(files) >= 5, files


@pytest.mark.parametrize("path", sorted(named_paths()))
def test_named_path_exists_and_parses(path: str) -> None:
    target = ROOT / path
    if path.endswith("/"):
        assert target.is_dir(), f"{path} (named in {named_paths()[path]}) is not a folder"
        return
    assert target.is_file(), f"{path} (named in {named_paths()[path]}) is missing"
    text = target.read_text(encoding="utf-8")
    if target.suffix == ".json":
        data = json.loads(text)
        assert data, f"{path} is empty"
    elif target.suffix == ".csv":
        rows = list(csv.reader(text.splitlines()))
        assert len(rows) >= 2 and all(rows[0]), f"{path}: no header or no rows"
    elif target.suffix == ".jsonl":  # a trace: one JSON object per line
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert lines and all(isinstance(x, dict) for x in lines), f"{path}: no JSON rows"
    else:
        pytest.fail(f"{path}: only .json, .jsonl and .csv results are expected")


def test_no_orphan_result_files() -> None:
    named = set(named_paths())
    orphans = [f for f in _files_in_results() if f not in named]
    assert not orphans, f"files in bench/results/ that no doc names: {orphans}"


def test_result_files_are_small() -> None:
    big = [f for f in _files_in_results() if (ROOT / f).stat().st_size > 1_000_000]
    assert not big, f"result files over 1 MB (commit summaries, not traces): {big}"


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)
def test_result_files_are_not_ignored() -> None:
    files = _files_in_results()
    assert files
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert not ignored, f"git ignores these result files: {ignored}"
