"""A running request's expected remaining output, from the served model's forecasts.

The one place that turns what is known about a request's length into the number of output
tokens a policy should expect it still to produce: the arrival-time prediction (with ALISE's
doubling on a miss, kept by the policy) until the first forecast, then the latest
`RemainingForecast` (quantiles of the remaining tokens counted from `generated`, and
P(runs to max_tokens)), shifted by the tokens generated since it was made and cut at what
`max_tokens` and the length limit still allow.

A forecast is read as `POINTS` equally likely remaining lengths: the share 1 - p_cap that ends
on EOS follows a two-piece lognormal through q10 / q50 / q90 (so a skewed forecast keeps its
skew), the share p_cap runs to the cap. Given that the request is still running `e` tokens
after the forecast, the points above `e` are what is left. The rules (knob `forecast_rule`):

* `median`: SRPT on the median of what is left;
* `quantile`: SRPT on a conservative quantile (`forecast_quantile`, e.g. 0.7);
* `mean`: SRPT on the expectation (heavy tails and p_cap weigh in fully);
* `gittins`: the Gittins index for mean response time (Gittins; Scully et al.'s SOAP view of
  it): the least expected work per unit of completion probability,
  min over d of E[min(R, d)] / P(R <= d). A request that may end soon but may also run to the
  cap gets a short key (it is worth trying), one whose whole distribution is long a long key.

Pure arithmetic (no torch, no I/O): `statistics.NormalDist` gives the normal quantiles.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.step import RemainingForecast
    from services.scheduler.core.request import Request

RULES = ("off", "median", "quantile", "mean", "gittins")
POINTS = 16  # equally likely remaining lengths per forecast
Z90 = NormalDist().inv_cdf(0.9)
_INV = NormalDist().inv_cdf


def cap_left(req: Request, generated: int) -> float:
    """Output tokens `req` may still produce after `generated`: max_tokens, and the length
    limit when the scheduler has set one."""
    left = req.max_tokens - generated
    if req.max_model_len is not None:
        left = min(left, req.max_model_len - req.num_prompt_tokens - generated)
    return float(max(left, 1))


def forecast_points(fc: RemainingForecast, cap: float) -> list[float]:
    """`POINTS` equally likely remaining lengths (tokens after `fc.generated`), sorted, none
    beyond `cap` (what max_tokens allowed when the forecast was made)."""
    q50 = min(max(fc.q50, 1.0), cap)
    lo = min(max(fc.q10, 0.5), q50)
    hi = max(fc.q90, q50)
    s_lo, s_hi = math.log(q50 / lo) / Z90, math.log(hi / q50) / Z90
    p = min(max(fc.p_cap, 0.0), 1.0)
    out = []
    for i in range(POINTS):
        u = (i + 0.5) / POINTS
        if u >= 1.0 - p:
            out.append(cap)
            continue
        z = _INV(u / (1.0 - p))
        x = q50 * math.exp(z * (s_hi if z > 0 else s_lo))
        out.append(min(x, cap))
    out.sort()
    return out


def expected_remaining(points: list[float], elapsed: int, rule: str, quantile: float) -> float:
    """Remaining tokens by `rule`, given the forecast's `points` and `elapsed` tokens generated
    since it was made. A request that outlived every point is expected to run as long again
    as it has run since the forecast (a blind doubling until the next forecast)."""
    left = [x - elapsed for x in points if x > elapsed]
    if not left:
        return float(max(elapsed, 1))
    m = len(left)
    if rule == "median":
        value = left[m // 2] if m % 2 else (left[m // 2 - 1] + left[m // 2]) / 2
    elif rule == "quantile":
        value = left[min(m - 1, int(quantile * m))]
    elif rule == "mean":
        value = sum(left) / m
    elif rule == "gittins":
        value = gittins_key(left)
    else:
        raise ValueError(f"forecast rule must be one of {RULES[1:]}, got {rule!r}")
    return max(value, 1.0)


def gittins_key(left: list[float]) -> float:
    """min over thresholds d (each point) of E[min(R, d)] / P(R <= d), for R uniform over the
    sorted `left`: the inverse of the Gittins index, in tokens."""
    m, best, below = len(left), math.inf, 0.0
    for j, d in enumerate(left, 1):
        below += d
        key = (below + (m - j) * d) / j
        if key < best:
            best = key
    return best


def remaining_tokens(
    req: Request, arrival_pred: int, rule: str, quantile: float, points: list[float] | None
) -> float:
    """What a policy should expect `req` still to output: from its forecast's `points`
    (`forecast_points` of `req.forecast`, cached by the caller) when it has one and `rule`
    is not `off`, else from the arrival prediction `arrival_pred` (a total length)."""
    n = req.num_output_tokens
    fc = req.forecast
    if fc is None or rule == "off" or points is None:
        return float(max(arrival_pred - n, 1))
    value = expected_remaining(points, n - fc.generated, rule, quantile)
    return min(value, cap_left(req, n))
