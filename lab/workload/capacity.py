"""Capacity: the highest request rate at which a latency criterion still holds.

Criteria read a metrics summary (lab.workload.metrics.summarize):
- `normalized_latency`: mean normalized latency <= bound (ALISE; default 0.2 s/token);
- `p99_tbt`: P99 TBT <= the TBT SLO and median scheduling delay <= 2 s (Sarathi-Serve).
The search is a bisection on rate between a passing and a failing rate; evaluations are
cached by rate, and `bisect_many` advances several searches together so a caller can run each
round's probes in parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

CRITERIA = ("normalized_latency", "p99_tbt")


@dataclass(frozen=True)
class Criterion:
    name: str
    bound: float  # s/token for normalized_latency; the TBT SLO (s) for p99_tbt
    max_scheduling_delay_s: float = 2.0

    def __post_init__(self):
        if self.name not in CRITERIA:
            raise ValueError(f"unknown capacity criterion {self.name!r}: {', '.join(CRITERIA)}")

    def passes(self, summary: dict) -> bool:
        if summary.get("completed", 0) < summary.get("num_requests", 0):
            return False
        if self.name == "normalized_latency":
            value = summary.get("mean_normalized_latency")
            return value is not None and value <= self.bound
        tbt, delay = summary.get("p99_tbt"), summary.get("median_scheduling_delay")
        return (
            tbt is not None
            and tbt <= self.bound
            and delay is not None
            and delay <= self.max_scheduling_delay_s
        )


def sarathi_tbt_slo(
    iteration_time: Callable[[int, int, int], float],
    factor: float = 5.0,
    batch: int = 32,
    prompt_len: int = 4096,
) -> float:
    """Sarathi-Serve's P99 TBT SLO: `factor` (5 strict, 25 relaxed) x the time of a decode
    iteration of `batch` requests with `prompt_len` tokens of context each, uncontended."""
    return factor * iteration_time(0, batch, batch * prompt_len)


@dataclass
class Search:
    """Bisection state for one (key, criterion): `lo` passes (or None), `hi` fails (or None)."""

    key: str
    criterion: Criterion
    lo: float | None = None
    hi: float | None = None
    probes: list[tuple[float, bool]] = field(default_factory=list)

    def observe(self, rate: float, summary: dict) -> None:
        """Record a probe; hi = lowest failing rate, lo = highest passing rate below it."""
        self.probes.append((rate, self.criterion.passes(summary)))
        failing = [r for r, ok in self.probes if not ok]
        self.hi = min(failing) if failing else None
        passing = [r for r, ok in self.probes if ok and (self.hi is None or r < self.hi)]
        self.lo = max(passing) if passing else None

    def next_rate(self, rel_tol: float) -> float | None:
        """The next rate to probe, or None when the bracket is tight enough (or open)."""
        if self.lo is None or self.hi is None:
            return None
        if (self.hi - self.lo) <= rel_tol * self.hi:
            return None
        return round((self.lo + self.hi) / 2, 6)

    def result(self) -> dict:
        """capacity = highest passing rate; `bounded` false when even the top rate passed
        (capacity >= it) or nothing passed (capacity < the lowest rate probed)."""
        return {
            "capacity": self.lo if self.lo is not None else 0.0,
            "bounded": self.lo is not None and self.hi is not None,
            "lowest_failing": self.hi,
            "probes": sorted(self.probes),
        }


def bisect_many(
    searches: list[Search],
    evaluate_all: Callable[[list[tuple[str, float]]], dict],
    rel_tol: float = 0.05,
    max_rounds: int = 6,
) -> None:
    """Refine every search; `evaluate_all([(key, rate)]) -> {(key, rate): summary}`."""
    for _ in range(max_rounds):
        wanted = {}
        for s in searches:
            rate = s.next_rate(rel_tol)
            if rate is not None:
                wanted.setdefault((s.key, rate), []).append(s)
        if not wanted:
            return
        summaries = evaluate_all(list(wanted))
        for (key, rate), group in wanted.items():
            for s in group:
                s.observe(rate, summaries[(key, rate)])
