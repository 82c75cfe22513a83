"""Levels by predicted remaining time (ALISE's speculative SRTF), the part `alise`, `oracle`
and `hybrid` hold: `RemainingRank` says which level a request belongs in.

* Level 0 holds jobs with less than `queue_base_s` of predicted work left; level i those below
  queue_base_s * queue_ratio**i (the last level takes the rest), minus the levels aging gave.
  `rank="normalized"` orders by remaining time x predicted length / `rank_ref_len` instead:
  Smith's rule (shortest work per unit of weight first) with weight 1 / output length, the
  order that minimises mean *normalized* latency (ALISE's metric) rather than mean latency.
* Demotion: a job that outlives its prediction gets the prediction doubled, which raises its
  remaining-time estimate and so moves it to a lower-priority queue.
* Forecasts: when the served model sends a forecast of the remaining length (Request.forecast),
  `forecast_rule` turns it into the prediction (core/remaining.py) instead of doubling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.scheduler.core.policies.base import KnobError
from services.scheduler.core.policies.parts.levels import bucket
from services.scheduler.core.remaining import RULES, cap_left, forecast_points, remaining_tokens

if TYPE_CHECKING:
    from services.common.step import RemainingForecast
    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.request import Request

Rank = Literal["remaining", "normalized"]
RANKS = ("remaining", "normalized")
Prior = Callable[["Request"], int]  # the output length assumed when a request arrives


def arrival_prior(default_len: int) -> Prior:
    """The request's own (arrival) prediction, else `default_len`."""

    def prior(req: Request) -> int:
        return req.predicted_len or default_len

    return prior


@dataclass(frozen=True)
class RankRule:
    """The knobs of `RemainingRank` (see the module docstring)."""

    queue_base_s: float | None = None  # None: 16 decode iterations (16 * beta of the cost model)
    queue_ratio: float = 2.0
    default_predicted_len: int = 256  # prior when a request carries no prediction
    rank: Rank = "remaining"
    rank_ref_len: float = 16  # normalized: the length whose key equals its time left
    forecast_rule: str = "median"  # off | median | quantile | mean | gittins
    forecast_quantile: float = 0.7

    def __post_init__(self) -> None:
        if self.queue_ratio <= 1:
            raise KnobError("queue_ratio must be > 1")
        if self.default_predicted_len < 1:
            raise KnobError("default_predicted_len must be >= 1")
        if self.rank not in RANKS:
            raise KnobError(f"rank must be one of {RANKS}, got {self.rank!r}")
        if self.rank_ref_len <= 0:
            raise KnobError("rank_ref_len must be > 0")
        if self.forecast_rule not in RULES:
            raise KnobError(f"forecast_rule must be one of {RULES}, got {self.forecast_rule!r}")
        if not 0 < self.forecast_quantile < 1:
            raise KnobError("forecast_quantile must be in (0, 1)")


class RemainingRank:
    """Predicted lengths per request and the level they give, from `prior` at arrival (the
    arrival prediction unless given another). An `exact` prior (oracle's true lengths) needs
    no forecast: they are ignored."""

    def __init__(
        self,
        rule: RankRule,
        cost: CostModel,
        num_queues: int,
        boost: dict[str, int],
        prior: Prior | None = None,
        exact: bool = False,
    ) -> None:
        self.rule, self.cost, self.num_queues = rule, cost, num_queues
        self.boost = boost  # levels gained by aging (the Levels part's)
        self.prior = prior or arrival_prior(rule.default_predicted_len)
        self.exact = exact
        self.base = rule.queue_base_s or 16 * cost.beta  # bound of level 0, seconds
        self.pred: dict[str, int] = {}  # current predicted output length per request
        self.demotions: dict[str, int] = {}  # times each request outgrew its prediction
        # per request: its forecast and that forecast's points (core/remaining.py), once made
        self.points: dict[str, tuple[RemainingForecast, list[float]]] = {}

    def initial(self, req: Request) -> int:
        """The output length assumed when `req` arrives."""
        return self.prior(req)

    def predicted(self, req: Request) -> int:
        """The output length believed in now."""
        return self.pred.get(req.request_id) or self.initial(req)

    def arrived(self, req: Request) -> tuple[int, float]:
        """(level, predicted remaining seconds) of a new or re-admitted request (one
        re-admitted with output beyond its prediction, or with a forecast, is refined)."""
        self.pred[req.request_id] = self.initial(req)
        self._refine(req)
        return self.level(req)

    def ran(self, req: Request) -> tuple[int, float]:
        """(level, remaining seconds) after a step it ran in."""
        self._refine(req)
        return self.level(req)

    def level(self, req: Request) -> tuple[int, float]:
        rid, r = req.request_id, self.rule
        pred = self.pred[rid]
        rem = self.cost.remaining_time(req, pred)
        key = rem * pred / r.rank_ref_len if r.rank == "normalized" else rem
        level = bucket(key, self.base, r.queue_ratio, self.num_queues) - self.boost.get(rid, 0)
        return level, rem

    def _refine(self, req: Request) -> None:
        """The predicted length after this step: from the latest forecast of the served model
        when there is one (rule `forecast_rule`), else ALISE's doubling."""
        fc, r = req.forecast, self.rule
        if fc is None or r.forecast_rule == "off" or self.exact:
            self._outgrow(req)
            return
        rid = req.request_id
        cached = self.points.get(rid)
        if cached is None or cached[0] is not fc:
            cached = (fc, forecast_points(fc, cap_left(req, fc.generated)))
            self.points[rid] = cached
        left = remaining_tokens(
            req, self.pred[rid], r.forecast_rule, r.forecast_quantile, cached[1]
        )
        self.pred[rid] = req.num_output_tokens + max(1, math.ceil(left))

    def _outgrow(self, req: Request) -> None:
        """Demotion: double the prediction until it exceeds the output so far."""
        rid = req.request_id
        pred = self.pred[rid]
        if req.num_output_tokens >= pred:
            while req.num_output_tokens >= pred:
                pred *= 2
            self.pred[rid] = pred
            self.demotions[rid] = self.demotions.get(rid, 0) + 1

    def finish(self, rid: str) -> None:
        self.pred.pop(rid, None)
        self.demotions.pop(rid, None)
        self.points.pop(rid, None)
