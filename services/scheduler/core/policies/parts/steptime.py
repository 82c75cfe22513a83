"""Step-time arithmetic for `hybrid`'s SLO-driven steps.

* `AttentionFit`: the seconds per (prefill token, attended token) pair that the linear cost
  model leaves out (the O(n^2) attention of a chunk over its prompt so far), fitted online by
  least squares through the origin of each step's residual (measured minus the cost model's
  time) against its pairs, with exponential forgetting. It stays at 0 where the model is right
  (short prompts, a roofline clock without the attention term).
* `chunk_tokens`: the largest chunk of one prompt whose time (per-token cost, the reads of its
  own context, the fitted attention) fits what is left of a step's time.
* `efficient_batch` / `efficient_chunk`: the smallest decode batch / prefill chunk whose
  tokens per second on the cost model reach a share of what an unbounded one reaches: past
  them a step grows in time almost as fast as in tokens, so running more at once mostly
  shares the same throughput among more requests (processor sharing, which delays them all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.arith import ceil_div

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.request import Request


class AttentionFit:
    def __init__(self, decay: float = 0.99) -> None:
        self.coef = 0.0  # seconds per (prefill token, attended token) pair
        self.decay = decay
        self._sxy = 0.0
        self._sxx = 0.0

    @staticmethod
    def pairs(scheduled: Mapping[str, int], requests: Mapping[str, Request]) -> float:
        """(token, attended token) pairs of the prefill chunks of a step about to run."""
        total = 0.0
        for rid, n in scheduled.items():
            if n > 1:
                total += n * (requests[rid].num_computed_tokens + (n + 1) / 2)
        return total

    def observe(self, elapsed_s: float, model_s: float, pairs: float) -> None:
        if pairs <= 0:
            return
        d = self.decay
        self._sxy = d * self._sxy + (elapsed_s - model_s) * pairs
        self._sxx = d * self._sxx + pairs * pairs
        self.coef = max(0.0, self._sxy / self._sxx)


def chunk_tokens(cost: CostModel, coef: float, time_left: float, context: int, n: int) -> int:
    """Largest m <= n tokens of a prompt with `context` tokens computed whose chunk costs at
    most `time_left`: m (c_prefill + c_context) + c_context context + coef m (context + m/2)."""
    u = cost.c_prefill + cost.c_context
    t = time_left - cost.c_context * context
    if t <= 0 or n < 1:
        return 0
    qa, qb = coef / 2, u + coef * context
    if qa <= 0:
        m = int(t / qb) if qb > 0 else n
    else:  # the positive root of qa m^2 + qb m - t, in the form without cancellation
        m = int(2 * t / (qb + (qb * qb + 4 * qa * t) ** 0.5))
    return min(n, m)


def chunk_time(cost: CostModel, coef: float, context: int, m: int) -> float:
    """What `chunk_tokens` charges for a chunk of m tokens beyond m (c_prefill + c_context)."""
    return cost.c_context * context + coef * m * (context + m / 2)


LARGE = 1 << 16  # a batch or chunk standing in for "unbounded"


def _smallest(rate: Callable[[int], float], share: float, hi: int) -> int | None:
    """Smallest n in [1, hi] with rate(n) >= share * rate(LARGE) (rate increasing in n)."""
    target = share * rate(LARGE)
    if target <= 0:
        return None
    if rate(hi) < target:
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if rate(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _per_second(tokens: int, seconds: float) -> float:
    """Tokens per second; 0 where the cost model gives no time (no curve to read)."""
    return tokens / seconds if seconds > 0 else 0.0


def efficient_batch(cost: CostModel, share: float, context: int, most: int) -> int | None:
    """Smallest decode batch (rows of `context` tokens each) reaching `share` of the decode
    throughput of an unbounded batch, or None when it takes more than `most` rows."""
    return _smallest(lambda n: _per_second(n, cost.iteration_time(0, n, n * context)), share, most)


def efficient_chunk(cost: CostModel, share: float, tile: int, most: int) -> int:
    """Smallest multiple of `tile` whose prefill throughput reaches `share` of an unbounded
    chunk's, at most `most`."""
    n = _smallest(lambda m: _per_second(m, cost.iteration_time(m, 0, m)), share, most)
    n = most if n is None else n
    return min(most, max(tile, ceil_div(n, tile) * tile))
