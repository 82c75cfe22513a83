"""The served model's calibration files: its own answer lengths for ShareGPT prompts, as the
predictor reads them when it seeds and the lab scores predictors on them.

Two formats, both one JSON line per prompt after a header line `{"header": {model, max_tokens,
temperature, seed, split[, draws]}}`:

- **several draws** (`{model}-cap{N}-{regime}[-{split}].jsonl`, regime `t1` for sampled
  answers at temperature > 0, `t0` for greedy ones):
  `{"id", "prompt_len", "temperature", "lengths": [...], "censored": [...]}`, one entry per
  draw of the same prompt (ProD: a prompt has a length *distribution*);
- **one draw** (the older `{model}-cap{N}[-{split}].jsonl`, temperature 1):
  `{"id", "length", "censored", "prompt_len"}`; read as one draw at the header's temperature.

`censored` marks a draw cut by the cap (its length is only a lower bound). `read_draws` reads
either format into `PromptDraws`; `read_calibration` is the one-draw view (the first draw).
Next to a file, `<stem>.features.npz` may hold the executor probe's features at each
checkpoint of each draw (`read_features`). `lab/predictor/calibrate.py` (`alise predictor
calibrate`) writes them; `calibration_file` finds the one for a model, cap, split and regime
(the data dir's, else one bundled in services/predictor/calibration/).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from services.predictor.sharegpt import Sample

BUNDLED = Path(__file__).parent / "calibration"
# several-draws files with the probe's features (issue 30), bundled apart: a regime seeds
# from one only when it has no file in BUNDLED (t0 does; t1 keeps the larger one-draw file)
DRAWS = BUNDLED / "draws"
DEFAULT_CAP = 256
REGIMES = ("t0", "t1")


def regime(temperature: float) -> str:
    """The temperature regime a calibration (or a probe) is keyed by: greedy or sampled."""
    return "t0" if temperature <= 0 else "t1"


def calibration_name(
    model: str, max_tokens: int, split: str = "train", regime: str | None = None
) -> str:
    """The file name; regime None = the older one-draw name (temperature 1, no regime)."""
    tail = "" if split == "train" else f"-{split}"
    mid = "" if regime is None else f"-{regime}"
    return f"{model}-cap{max_tokens}{mid}{tail}.jsonl"


def calibration_file(
    model: str,
    data_dir: Path,
    max_tokens: int = DEFAULT_CAP,
    split: str = "train",
    regime: str | None = None,
) -> Path | None:
    """The calibration file for `model` at `max_tokens` over `split`: the data dir's (written
    by `calibrate`), else one bundled with the package, else None. `regime` ("t0" / "t1")
    asks for a file of that temperature regime; for "t1" an older one-draw file (temperature
    1) comes next, and last the regime's bundled several-draws file (DRAWS). So `t1` seeds from
    the 2,000-prompt one-draw file rather than the several-draws one (no better at 508
    prompts: docs/predictor.md, "Per regime") and `t0` from its own greedy file. None = the older one-draw file only."""
    own = calibration_name(model, max_tokens, split, regime)
    names = [own] + ([calibration_name(model, max_tokens, split)] if regime == "t1" else [])
    paths = [base / name for name in names for base in (data_dir / "calibration", BUNDLED)]
    paths += [DRAWS / own] if regime is not None else []
    return next((p for p in paths if p.exists()), None)


def draws_file(model: str, data_dir: Path, max_tokens: int, split: str, regime: str) -> Path | None:
    """A several-draws file of `regime` (no one-draw fallback): the data dir's, else the
    bundled one in DRAWS, else None."""
    name = calibration_name(model, max_tokens, split, regime)
    for base in (data_dir / "calibration", DRAWS):
        if (base / name).exists():
            return base / name
    return None


@dataclass(frozen=True)
class PromptDraws:
    """Every recorded draw of one prompt at one temperature."""

    id: str
    prompt_len: int
    temperature: float
    lengths: tuple[int, ...]
    censored: tuple[bool, ...]

    @property
    def median(self) -> float:
        """Median length over the draws (a censored draw counts at its cut length)."""
        return float(statistics.median(self.lengths))

    @property
    def capped_share(self) -> float:
        """Share of draws cut by the cap."""
        return sum(self.censored) / len(self.censored)

    @property
    def log_spread(self) -> float:
        """Standard deviation of log1p(length) over the draws (0 with one draw)."""
        return float(np.std(np.log1p(np.asarray(self.lengths, dtype=np.float64))))


def _draws_of(row: dict, temperature: float) -> PromptDraws:
    if "lengths" in row:
        return PromptDraws(
            row["id"],
            int(row["prompt_len"]),
            float(row.get("temperature", temperature)),
            tuple(int(n) for n in row["lengths"]),
            tuple(bool(c) for c in row["censored"]),
        )
    return PromptDraws(
        row["id"], int(row["prompt_len"]), temperature, (int(row["length"]),), (row["censored"],)
    )


def read_draws(path: Path) -> tuple[dict, dict[str, PromptDraws]]:
    """(header, id -> PromptDraws) of a calibration file of either format; a one-draw file
    gives one draw per prompt at its header's temperature (1.0 when it names none)."""
    header: dict = {}
    rows: dict[str, PromptDraws] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if "header" in row:
                header = row["header"]
            else:
                rows[row["id"]] = _draws_of(row, float(header.get("temperature", 1.0)))
    return header, rows


def read_calibration(path: Path) -> tuple[dict, dict[str, dict]]:
    """(header, id -> row) of a calibration file, one-draw view: `{"id", "length",
    "censored", "prompt_len"}` (the first draw of a several-draws file)."""
    header, draws = read_draws(path)
    rows = {
        pid: {
            "id": pid,
            "length": d.lengths[0],
            "censored": d.censored[0],
            "prompt_len": d.prompt_len,
        }
        for pid, d in draws.items()
    }
    return header, rows


def calibrated_samples(samples: list[Sample], rows: dict[str, dict]) -> list[Sample]:
    """The samples that were calibrated, with the served model's length as `output_len`."""
    from dataclasses import replace

    return [replace(s, output_len=int(rows[s.id]["length"])) for s in samples if s.id in rows]


# -- the probe's features at the checkpoints of each draw ---------------------------------------


def features_path(path: Path) -> Path:
    """The features sidecar of a calibration file: `<stem>.features.npz`."""
    return path.with_name(path.name.removesuffix(".jsonl") + ".features.npz")


@dataclass
class FeatureRows:
    """One row per (prompt, draw, checkpoint): the executor probe's feature vector `x` after
    `generated` output tokens of that draw, and the label: `remaining` output tokens from
    there until the draw ended or hit the cap (`censored`: it hit the cap, so the true
    remaining is at least this)."""

    ids: np.ndarray  # str [N] prompt ids
    draw: np.ndarray  # int [N]
    generated: np.ndarray  # int [N]
    remaining: np.ndarray  # int [N]
    censored: np.ndarray  # bool [N]
    x: np.ndarray  # float16 [N, F]
    names: list[str]  # F feature names (services/executor/probe.py FEATURE_NAMES + hidden)

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, mask: np.ndarray) -> FeatureRows:
        return FeatureRows(
            self.ids[mask],
            self.draw[mask],
            self.generated[mask],
            self.remaining[mask],
            self.censored[mask],
            self.x[mask],
            self.names,
        )


FEATURE_KEYS = ("ids", "draw", "generated", "remaining", "censored", "x")


def write_features(path: Path, rows: FeatureRows) -> None:
    """Write (compressed) `rows` to `path`."""
    arrays = {k: getattr(rows, k) for k in FEATURE_KEYS}
    arrays["x"] = rows.x.astype(np.float16)
    np.savez_compressed(path, names=np.asarray(rows.names), **arrays)


def read_features(path: Path) -> FeatureRows:
    """The feature rows of a `.features.npz` file (`features_path` of a calibration file)."""
    with np.load(path, allow_pickle=False) as z:
        return FeatureRows(
            z["ids"].astype(str),
            z["draw"].astype(np.int64),
            z["generated"].astype(np.int64),
            z["remaining"].astype(np.int64),
            z["censored"].astype(bool),
            z["x"],
            [str(n) for n in z["names"]],
        )


def concat_features(parts: list[FeatureRows]) -> FeatureRows:
    if not parts:
        raise ValueError("no feature rows")
    return FeatureRows(
        *(np.concatenate([getattr(p, k) for p in parts]) for k in FEATURE_KEYS),
        names=parts[0].names,
    )
