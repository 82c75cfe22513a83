"""Replay CSV traces with real timestamps and token counts.

Two column layouts are recognised from the header:
- Azure LLM inference traces: `TIMESTAMP, ContextTokens, GeneratedTokens`, timestamps as
  `2023-11-16 18:15:46.6805900` (any number of fractional digits) or plain seconds;
- BurstGPT: `Timestamp, Request tokens, Response tokens` (+ other columns), seconds.
Rows whose prompt or answer has no tokens (BurstGPT logs failed requests with 0 response
tokens) are dropped and counted.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from lab.workload.traces.trace import Shape

FORMATS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}


@dataclass
class CsvTrace:
    format: str
    timestamps: list[float]  # seconds, as in the file (not shifted)
    shapes: list[Shape]
    dropped: int  # rows with a zero token count


def detect_format(header: list[str]) -> str:
    names = {h.strip() for h in header}
    for fmt, cols in FORMATS.items():
        if set(cols) <= names:
            return fmt
    raise ValueError(
        f"unrecognised CSV header {header}: expected the columns of one of "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in FORMATS.items())
    )


def parse_timestamp(text: str) -> float:
    """Seconds: a number as is, or an ISO-like date-time (fraction truncated to microseconds)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    head, dot, frac = text.partition(".")
    if dot:
        frac = "".join(c for c in frac if c.isdigit())[:6]
        text = f"{head}.{frac}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError as exc:
        raise ValueError(f"cannot parse timestamp {text!r}") from exc


def _int(value: str, column: str, lineno: int) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"line {lineno}: column {column!r} is not a number: {value!r}") from exc


def load_csv(path: str | Path, limit: int | None = None) -> CsvTrace:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        fmt = detect_format(header)
        t_col, p_col, o_col = (header.index(c) for c in FORMATS[fmt])
        timestamps, shapes, dropped = [], [], 0
        for lineno, row in enumerate(reader, 2):
            if not row or all(not c.strip() for c in row):
                continue
            prompt_len = _int(row[p_col], FORMATS[fmt][1], lineno)
            output_len = _int(row[o_col], FORMATS[fmt][2], lineno)
            if prompt_len < 1 or output_len < 1:
                dropped += 1
                continue
            timestamps.append(parse_timestamp(row[t_col]))
            shapes.append(Shape(prompt_len, output_len, sample_id=f"{path.stem}:{lineno}"))
            if limit is not None and len(shapes) >= limit:
                break
    if not shapes:
        raise ValueError(f"{path}: no usable rows")
    order = sorted(range(len(shapes)), key=lambda i: (timestamps[i], i))  # stable by time
    return CsvTrace(fmt, [timestamps[i] for i in order], [shapes[i] for i in order], dropped)
