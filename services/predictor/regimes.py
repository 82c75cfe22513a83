"""Temperature regimes and several draws per prompt: what the predictor learns per prompt.

A prompt's answer length is a distribution, not a number (one draw at temperature 1 agrees
with another at Kendall tau 0.05 for SmolLM2-135M, docs/predictor.md), and it is another
distribution at temperature 0 (one answer per prompt) than at temperature 1. So the predictor
keeps one store and one MLP per **regime**, `t0` (greedy, temperature 0) and `t1` (sampled,
any temperature > 0), each per (model, cap), seeded from the calibration file of that regime:
`<model>-cap<N>-t1.jsonl` / `-t0.jsonl`, one JSON line per prompt with every draw,
`{"id", "prompt_len", "temperature", "lengths": [...], "censored": [...]}`. The older one-draw
file `<model>-cap<N>.jsonl` (`{"id", "length", "censored"}`) reads as one draw at temperature 1
(`services.predictor.calibration_files` reads and finds both).

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

from services.predictor.calibration_files import (
    DEFAULT_CAP,
    PromptDraws,
    calibration_file,
    read_draws,
    regime,
)

REGIMES = ("t1", "t0")  # the regimes served; the first is the fallback of one without a file

__all__ = ["REGIMES", "PromptDraws", "read_draws", "regime_file", "regime_of", "summarize_draws"]


def regime_of(temperature: float | None) -> str:
    """`t0` for greedy decoding (temperature 0, as the executor's sampler), `t1` for sampling;
    None (not sent) is the API default 1.0."""
    return "t1" if temperature is None else regime(temperature)


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
    return DrawSummary(length, draws.capped_share, draws.log_spread, len(lengths))


def regime_file(
    model: str, data_dir: Path, regime: str, max_tokens: int = DEFAULT_CAP, split: str = "train"
) -> Path | None:
    """The calibration file of `regime` (`calibration_files.calibration_file`: for `t1` the
    older one-draw file after the regime's own); None: the regime has no file (the service
    falls back to another regime's)."""
    return calibration_file(model, data_dir, max_tokens, split, regime)


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
