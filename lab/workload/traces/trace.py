"""A trace: what arrives when, how long its prompt is, how long its true answer is, its SLO.

Shared by the simulator and the live load generator, so it knows nothing about either. All
times are seconds; `arrival_s` is relative to the start of the trace, and every SLO field is
relative to the request's own arrival (a JCT deadline of 30 s means "done within 30 s of
arriving").
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class SloSpec:
    """Per-request latency objectives; `None` = no objective of that kind."""

    ttft_s: float | None = None
    tbt_s: float | None = None
    deadline_s: float | None = None

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tbt_s is None and self.deadline_s is None


@dataclass(frozen=True)
class Shape:
    """A request without its arrival time: the token counts (and text when known)."""

    prompt_len: int
    output_len: int
    prompt: str | None = None
    sample_id: str | None = None

    def __post_init__(self):
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"prompt_len and output_len must be >= 1, got {self.prompt_len}, {self.output_len}"
            )


@dataclass(frozen=True)
class TraceItem:
    """One request of a trace. `output_len` is the true length (generate exactly that many
    tokens with ignore_eos to replay it)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt: str | None = None
    sample_id: str | None = None
    slo: SloSpec = field(default_factory=SloSpec)
    # What the prompt is made of, for prefix caching: (segment id, tokens) in order; equal ids
    # are equal token runs (a shared system prompt, a conversation's earlier turns). None = a
    # prompt of its own. `messages` (role, text) is the chat a live replay sends.
    segments: tuple[tuple[str, int], ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    def with_slo(self, slo: SloSpec) -> TraceItem:
        return replace(self, slo=slo)


def build_trace(shapes: list[Shape], arrivals: list[float], prefix: str = "req") -> list[TraceItem]:
    """Pair shapes with arrival times (same length), in arrival order."""
    if len(shapes) != len(arrivals):
        raise ValueError(f"{len(shapes)} shapes but {len(arrivals)} arrival times")
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
    return [
        TraceItem(
            f"{prefix}-{k}",
            float(arrivals[i]),
            shapes[i].prompt_len,
            shapes[i].output_len,
            shapes[i].prompt,
            shapes[i].sample_id,
        )
        for k, i in enumerate(order)
    ]


def save_jsonl(items: Iterable[TraceItem], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            row = asdict(item)
            row["slo"] = {k: v for k, v in row["slo"].items() if v is not None}
            f.write(json.dumps(row) + "\n")


def load_jsonl(path: str | Path) -> list[TraceItem]:
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                row["slo"] = SloSpec(**row.get("slo", {}))
                for key in ("segments", "messages"):
                    if row.get(key) is not None:
                        row[key] = tuple(tuple(part) for part in row[key])
                items.append(TraceItem(**row))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace item: {exc}") from exc
    return items
