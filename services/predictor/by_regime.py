"""One `LengthPredictor` per temperature regime (`services.predictor.regimes`), sharing the
embedder, the store (each regime its own collection) and the embedding cache.

A request's temperature picks its regime; a regime the service has no calibration file for
is answered, and taught, by the fallback regime (`t1`, the first of `REGIMES`): its
predictions say so in their source (`mlp@t1` = the `t1` MLP answered a `t0` request) and in
`regime`, and the service logs it once per regime.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from services.predictor.core import LengthPredictor, Observation, Prediction
from services.predictor.regimes import REGIMES, regime_of
from services.predictor.store_base import LengthStore

log = logging.getLogger(__name__)


class RegimePredictors:
    def __init__(self, predictors: dict[str, LengthPredictor]) -> None:
        if REGIMES[0] not in predictors:
            raise ValueError(f"the fallback regime {REGIMES[0]!r} needs a predictor")
        self.by_regime = predictors
        self._warned: set[str] = set()

    @property
    def primary(self) -> LengthPredictor:
        """The fallback regime's predictor (also the one of requests without a temperature)."""
        return self.by_regime[REGIMES[0]]

    @property
    def store(self) -> LengthStore | None:
        return self.primary.store

    def pick(self, temperature: float | None) -> tuple[LengthPredictor, bool]:
        """(the predictor for a request at `temperature`, whether it is a fallback)."""
        regime = regime_of(temperature)
        own = self.by_regime.get(regime)
        if own is not None:
            return own, False
        if regime not in self._warned:
            self._warned.add(regime)
            log.warning(
                "no calibration file for temperature regime %s: its requests are predicted "
                "(and learnt) by regime %s (source label '<source>@%s')",
                regime,
                self.primary.regime,
                self.primary.regime,
            )
        return self.primary, True

    def predict(
        self, model: str, prompts: Sequence[str], temperature: float | None = None
    ) -> list[Prediction]:
        predictor, fallback = self.pick(temperature)
        preds = predictor.predict(model, prompts)
        if not fallback:
            return preds
        return [replace(p, source=f"{p.source}@{predictor.regime}") for p in preds]

    def observe(
        self, model: str, observations: Sequence[Observation], temperature: float | None = None
    ) -> int:
        return self.pick(temperature)[0].observe(model, observations)

    def compactions(self) -> int:
        """Store compactions so far (each store once; 0 where the backend has none)."""
        stores = {id(p.store): p.store for p in self.by_regime.values() if p.store}
        return sum(s.compactions for s in stores.values())

    def empty(self, model: str) -> set[str]:
        """The regimes whose collection of `model` holds no point."""
        return {r for r, n in self.count(model).items() if n == 0}

    def count(self, model: str) -> dict[str, int]:
        """Points per regime's collection."""
        return {r: p.store.count(p.key(model)) for r, p in self.by_regime.items() if p.store}
