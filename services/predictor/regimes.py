"""Temperature regimes and several draws per prompt: what the predictor learns per prompt.

A prompt's answer length is a distribution, not a number (one draw at temperature 1 agrees
with another at Kendall tau 0.05 for SmolLM2-135M, docs/predictor.md), and it is another
distribution at temperature 0 (one answer per prompt) than at temperature 1. So the predictor
keeps one store and one MLP per **regime**, `t0` (greedy, temperature 0) and `t1` (sampled,
any temperature > 0), each per (model, cap), seeded from the calibration file of that regime:
`<model>-cap<N>-t1.jsonl` / `-t0.jsonl`, one JSON line per prompt with every draw,
`{"id", "prompt_len", "temperature", "lengths": [...], "censored": [...]}`. The older one-draw
file `<model>-cap<N>.jsonl` (`{"id", "length", "censored"}`) reads as one draw at temperature 1.

Per prompt the seed keeps (`summarize_draws`): the **median** length of the draws that ended
on their own (the store's `length`, as before the typical length of an answer that ends), the
share of draws cut at the cap (`capped`, what `p_capped` is made of) and the **spread**, the
standard deviation of log1p(length) over the draws with cut ones counted at the cap (a lower
bound there; 0 with one draw: unknown).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.predictor.calibration_files import BUNDLED, DEFAULT_CAP, read_calibration

REGIMES = ("t1", "t0")  # the first is the fallback of a regime without a calibration file
GREEDY_BELOW = 1e-5  # a temperature at or below this is greedy decoding


def regime_of(temperature: float | None) -> str:
    """`t0` for greedy decoding, `t1` for sampling; None (not sent) is the API default 1.0."""
    return "t0" if temperature is not None and temperature <= GREEDY_BELOW else "t1"


@dataclass(frozen=True)
class PromptDraws:
    """One calibrated prompt: its answers' lengths and whether each was cut at the cap."""

    id: str
    lengths: tuple[int, ...]
    censored: tuple[bool, ...]

    @classmethod
    def from_row(cls, row: dict) -> PromptDraws:
        """A calibration line, several draws (`lengths`) or the older single draw (`length`)."""
        if "lengths" in row:
            lengths = tuple(int(n) for n in row["lengths"])
            cut = row.get("censored") or [False] * len(lengths)
            return cls(str(row["id"]), lengths, tuple(bool(c) for c in cut))
        return cls(str(row["id"]), (int(row["length"]),), (bool(row.get("censored", False)),))


@dataclass(frozen=True)
class DrawSummary:
    length: float  # median of the draws that ended on their own (all cut: the cap, a bound)
    capped: float  # share of the draws cut at the cap
    spread: float  # std of log1p(length) over the draws, cut ones at the cap (0: one draw)
    count: int  # draws


def summarize_draws(draws: PromptDraws) -> DrawSummary:
    lengths = np.asarray(draws.lengths, np.float64)  # [D]
    cut = np.asarray(draws.censored, bool)  # [D]
    ended = lengths[~cut]
    length = float(np.median(ended)) if len(ended) else float(lengths.max())
    spread = float(np.log1p(lengths).std()) if len(lengths) > 1 else 0.0
    return DrawSummary(length, float(cut.mean()), spread, len(lengths))


def regime_name(model: str, max_tokens: int, regime: str, split: str = "train") -> str:
    tail = "" if split == "train" else f"-{split}"
    return f"{model}-cap{max_tokens}-{regime}{tail}.jsonl"


def regime_file(
    model: str, data_dir: Path, regime: str, max_tokens: int = DEFAULT_CAP, split: str = "train"
) -> Path | None:
    """The calibration file of `regime`: `<model>-cap<N>-<regime>.jsonl` in the data dir, else
    bundled; for `t1` the older one-draw file `<model>-cap<N>.jsonl` (temperature 1) after it.
    None: the regime has no file (the service falls back to another regime's)."""
    from services.predictor.calibration_files import calibration_name

    names = [regime_name(model, max_tokens, regime, split)]
    if regime == "t1":
        names.append(calibration_name(model, max_tokens, split))
    for name in names:
        for base in (data_dir / "calibration", BUNDLED):
            if (base / name).exists():
                return base / name
    return None


def read_draws(path: Path) -> tuple[dict, dict[str, PromptDraws]]:
    """(header, id -> draws) of a calibration file of either format."""
    header, rows = read_calibration(path)
    return header, {key: PromptDraws.from_row(row) for key, row in rows.items()}


def file_tag(path: Path) -> str:
    """A short name for the seed a file gives, part of the store's and MLP's names: the older
    one-draw file keeps the names stores had before regimes (`cal<N>`)."""
    header = {}
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if first.strip():
        header = json.loads(first).get("header", {})
    cap = header.get("max_tokens", DEFAULT_CAP)
    stem = path.name.removesuffix(".jsonl")
    return f"cal{cap}" if stem.endswith(f"-cap{cap}") else f"cal{cap}-{stem.rsplit('-', 1)[-1]}"
