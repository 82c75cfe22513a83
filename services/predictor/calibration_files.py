"""The served model's calibration files, as the predictor reads them when it seeds: one JSON
line per train-split prompt, `{"id", "length", "censored", "prompt_len"}`, the first line a
header naming the model and cap. `lab/predictor/calibrate.py` (`alise predictor calibrate`)
writes them; `calibration_file` finds the one for a model and cap (the data dir's, else one
bundled in services/predictor/calibration/).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.workload.traces.sharegpt import Sample

BUNDLED = Path(__file__).parent / "calibration"
DEFAULT_CAP = 256


def calibration_name(model: str, max_tokens: int, split: str = "train") -> str:
    tail = "" if split == "train" else f"-{split}"
    return f"{model}-cap{max_tokens}{tail}.jsonl"


def calibration_file(
    model: str, data_dir: Path, max_tokens: int = DEFAULT_CAP, split: str = "train"
) -> Path | None:
    """The calibration file for `model` at `max_tokens` over `split`: the data dir's (written
    by `calibrate`), else one bundled with the package, else None."""
    for base in (data_dir / "calibration", BUNDLED):
        path = base / calibration_name(model, max_tokens, split)
        if path.exists():
            return path
    return None


def read_calibration(path: Path) -> tuple[dict, dict[str, dict]]:
    """(header, id -> row) of a calibration file."""
    header: dict = {}
    rows: dict[str, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if "header" in row:
                header = row["header"]
            else:
                rows[row["id"]] = row
    return header, rows


def calibrated_samples(samples: list[Sample], rows: dict[str, dict]) -> list[Sample]:
    """The samples that were calibrated, with the served model's length as `output_len`."""
    from dataclasses import replace

    return [replace(s, output_len=int(rows[s.id]["length"])) for s in samples if s.id in rows]
