"""Residual correction of the linear cost model from the profile's own measurements.

The four-coefficient fit is what policies reason with, but on a CPU the real iteration time is
not linear: one-sequence decode steps run 10-20% above the fit while big mixed batches run
below it (the profile's fit error is the spread). A simulator whose clock is the fit inherits
that error in every latency it reports. `Residuals` keeps, for every profile sample, the log of
measured / fitted time, and corrects a new batch by the inverse-distance-weighted mean of the
`k` samples nearest in shape. Shape = log1p of prefill tokens, of decode sequences and of the
context per sequence, weighted 1 : 2 : 0.5: a decode step is compared with decode steps of
the same few sequences first (on CPU one, two and three sequences differ by 40-70%, more than
any context length does), a 16-token prefill with small prefills. Far from every sample the
weights spread out and the correction fades towards the samples' mean ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def _shape(prefill: float, decode: float, context: float) -> tuple[float, float, float]:
    sequences = decode + (1 if prefill else 0)
    per_sequence = context / sequences if sequences else 0.0
    return math.log1p(prefill), 2.0 * math.log1p(decode), 0.5 * math.log1p(per_sequence)


class Residuals:
    def __init__(
        self,
        samples: list[dict[str, Any]],
        fitted: Callable[[float, float, float], float],
        k: int = 3,
    ) -> None:
        """`fitted(prefill, decode, context)` is the linear model's time for a batch."""
        self.k = k
        self.points: list[tuple[tuple[float, float, float], float]] = []
        for s in samples:
            p, d = s["prefill_tokens"], s["decode_tokens"]
            c, t = s.get("context_tokens", 0), s["time_s"]
            fit = fitted(p, d, c)
            if fit > 0 and t > 0:
                self.points.append((_shape(p, d, c), math.log(t / fit)))
        self._cache: dict[tuple[int, int, int], float] = {}

    def __bool__(self) -> bool:
        return len(self.points) >= self.k

    def ratio(self, prefill: int, decode: int, context: int) -> float:
        """Measured / fitted time expected for a batch of this shape."""
        key = (prefill, decode, context)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        x = _shape(prefill, decode, context)
        near = sorted((sum((a - b) ** 2 for a, b in zip(x, f)), r) for f, r in self.points)
        near = near[: self.k]
        if near[0][0] == 0.0:
            value = math.exp(near[0][1])
        else:
            weights = [1.0 / d2 for d2, _ in near]
            value = math.exp(sum(w * r for w, (_, r) in zip(weights, near)) / sum(weights))
        if len(self._cache) < 100_000:
            self._cache[key] = value
        return value
