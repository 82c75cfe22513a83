"""Output-length predictions inside the simulator, so prediction quality can be varied.

Specs: `oracle` (the true length), `mean` (one constant: `mean:value=N`, default the trace's
mean output length), `prior` (`prior:value=N`, default 256: no prediction at all, as for a trace
without prompt text; every request carries the constant prior that alise/hybrid assume
without a prediction (`default_predicted_len`), so that no policy falls back on `max_tokens`,
which the simulator sets to the true length), `noisy:sigma=S` (true length x exp(N(0, S^2)), seeded), `file:PATH`
(lengths produced offline by the real predictor: a JSON object {id: length} or JSONL rows
{"id": ..., "predicted_len": ...}; ids are trace sample ids or request ids).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lab.workload.traces.spec import parse_spec
from lab.workload.traces.trace import TraceItem

KINDS = ("oracle", "mean", "prior", "noisy", "file")
PRIOR_LEN = 256  # RankRule.default_predicted_len: what alise/hybrid assume without a prediction


def _load_file(path: str) -> dict[str, int]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"prediction file not found: {p}")
    text = p.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        return {str(k): int(v) for k, v in data.items()}
    out = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                out[str(row["id"])] = int(row["predicted_len"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f'{p}:{lineno}: expected {{"id", "predicted_len"}}') from exc
    return out


def _from_file(items: list[TraceItem], table: dict[str, int], path: str) -> list[int]:
    out, missing = [], []
    for item in items:
        value = table.get(item.sample_id or "", table.get(item.request_id))
        if value is None:
            missing.append(item.sample_id or item.request_id)
        out.append(max(1, value or 1))
    if missing:
        raise ValueError(
            f"{path}: no prediction for {len(missing)} of {len(items)} requests "
            f"(first: {missing[:3]})"
        )
    return out


def predict_lengths(
    items: list[TraceItem], spec: str = "oracle", seed: int = 0
) -> tuple[list[int], str]:
    """(predicted output length per item, prediction source name)."""
    kind, opts = parse_spec(spec)
    true = np.asarray([i.output_len for i in items], dtype=float)
    if kind == "oracle" and not opts:
        return [int(t) for t in true], "oracle"
    if kind == "mean" and set(opts) <= {"value"}:
        value = float(opts.get("value", true.mean() if len(true) else 1))
        return [max(1, round(value))] * len(items), "prior"
    if kind == "prior" and set(opts) <= {"value"}:
        value = int(opts.get("value", PRIOR_LEN))
        return [max(1, value)] * len(items), "prior"
    if kind == "noisy" and set(opts) <= {"sigma"}:
        sigma = float(opts.get("sigma", 0.5))
        if sigma < 0:
            raise ValueError(f"noisy prediction needs sigma >= 0, got {sigma}")
        noise = np.random.default_rng(seed + 7919).lognormal(0.0, sigma, size=len(items))
        return [max(1, round(t * e)) for t, e in zip(true, noise)], "noisy"
    if kind == "file" and "path" in opts:
        return _from_file(items, _load_file(opts["path"]), opts["path"]), "file"
    raise ValueError(
        f"bad prediction spec {spec!r}: oracle | mean[:value=N] | prior[:value=N] | "
        "noisy:sigma=S | file:PATH"
    )
