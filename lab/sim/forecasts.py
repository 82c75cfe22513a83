"""Progressive predictions inside the simulator: the served model's remaining-length forecasts
(`RemainingForecast`), emitted in each step's `StepOutcome.forecasts` at the executor's
checkpoints (the end of the prefill, then every `every` generated tokens, 16 by default as
`ALISE_PREDICT_EVERY`), so the core takes them by the same code path as live.

A prediction spec may add one after a `+`: `ARRIVAL+FORECAST`, e.g.
`file:bench/results/predictions_sharegpt_test.json+synthetic:sigma=1.0`. Sources:

* `synthetic[:sigma=1.0,floor=0.1,every=16,seed=0]` (**an ablation, not a measurement**): the
  true remaining length x exp(N(0, s^2)) with s = floor + (sigma - floor) x (remaining / total),
  the error shrinking as the request nears its end; quantiles from the same lognormal (a
  calibrated forecast), p_cap = P(that lognormal reaches the cap). Each checkpoint draws anew
  (seeded by request and checkpoint).
* `replay:PATH`: forecasts recorded for this trace (live, or by the probe's calibration), one
  JSON line per checkpoint: `{"id": ..., "generated": G, "q10": ..., "q50": ..., "q90": ...,
  "p_cap": ...}`; `id` is the trace's sample id or request id; `generated` and the quantiles
  as the executor's probe makes them: G the output tokens before the step that made it, the
  quantiles counting the tokens from there, that step's own token included (G = 0: the
  prefill's step). A request gets the row of G at the end of the step that samples its token
  G, the step the live executor made it in. `write_forecasts` writes the file.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from pathlib import Path
from statistics import NormalDist
from typing import Protocol

import numpy as np

from lab.workload.traces.spec import parse_spec
from services.common.step import RemainingForecast

FORECAST_KINDS = ("synthetic", "replay")
DEFAULT_EVERY = 16
Z90 = NormalDist().inv_cdf(0.9)


class ForecastSource(Protocol):
    label: str

    def at(self, key: str, generated: int, true_len: int, cap: int) -> RemainingForecast | None:
        """The forecast made for request `key` (sample id or request id) after `generated`
        output tokens, or None when none is made then. `true_len` is its real output length,
        `cap` what max_tokens allows (the synthetic source reads them; a replay does not)."""
        ...


def split_spec(spec: str) -> tuple[str, str | None]:
    """`ARRIVAL+FORECAST` -> (ARRIVAL, FORECAST); a spec without a forecast -> (spec, None)."""
    head, plus, tail = spec.rpartition("+")
    if plus and tail.partition(":")[0] in FORECAST_KINDS:
        return head, tail
    return spec, None


def is_checkpoint(generated: int, every: int) -> bool:
    """The executor's probe runs at the end of the prefill and every `every` tokens."""
    return generated == 1 or generated % every == 0


class SyntheticForecasts:
    """Forecasts whose log-error shrinks with progress (an ablation: the truth plus noise)."""

    def __init__(self, sigma: float, floor: float, every: int, seed: int) -> None:
        if sigma < 0 or floor < 0 or every < 1:
            raise ValueError("synthetic forecasts need sigma >= 0, floor >= 0, every >= 1")
        self.sigma, self.floor, self.every, self.seed = sigma, floor, every, seed
        self.label = f"synthetic:sigma={sigma},floor={floor} (ablation)"

    def spread(self, generated: int, true_len: int) -> float:
        """The log-error of a forecast made after `generated` of `true_len` tokens."""
        share = max(true_len - generated, 0) / max(true_len, 1)
        return self.floor + (self.sigma - self.floor) * share

    def at(self, key: str, generated: int, true_len: int, cap: int) -> RemainingForecast | None:
        if not is_checkpoint(generated, self.every) or generated >= true_len:
            return None
        s = self.spread(generated, true_len)
        rng = np.random.default_rng([self.seed, zlib.crc32(key.encode()), generated])
        left = true_len - generated
        cap_left = max(cap - generated, 1)
        median = max(left * math.exp(s * float(rng.standard_normal())), 1.0)
        p_cap = float(median >= cap_left)
        if s > 0:
            p_cap = 1.0 - NormalDist(math.log(median), s).cdf(math.log(cap_left))
        spread = math.exp(Z90 * s)
        q10, q50, q90 = (min(median * f, cap_left) for f in (1 / spread, 1.0, spread))
        return RemainingForecast(generated, q10, q50, q90, p_cap)


class ReplayForecasts:
    """Forecasts read from a JSONL file (format in the module docstring)."""

    def __init__(self, path: str) -> None:
        self.table = read_forecasts(path)
        self.label = f"replay:{path}"

    def at(self, key: str, generated: int, true_len: int, cap: int) -> RemainingForecast | None:
        # `generated` counts this step's token; the probe's rows count the tokens before it
        return self.table.get((key, generated - 1))


def read_forecasts(path: str) -> dict[tuple[str, int], RemainingForecast]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"forecast file not found: {p}")
    out: dict[tuple[str, int], RemainingForecast] = {}
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            fc = RemainingForecast(
                int(row["generated"]),
                float(row["q10"]),
                float(row["q50"]),
                float(row["q90"]),
                float(row["p_cap"]),
            )
            out[(str(row["id"]), fc.generated)] = fc
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f'{p}:{lineno}: expected {{"id", "generated", "q10", "q50", "q90", "p_cap"}}'
            ) from exc
    return out


def forecast_row(request_id: str, fc: RemainingForecast) -> dict:
    """One line of a forecast file (what a live run records per checkpoint)."""
    return {
        "id": request_id,
        "generated": fc.generated,
        "q10": fc.q10,
        "q50": fc.q50,
        "q90": fc.q90,
        "p_cap": fc.p_cap,
    }


def write_forecasts(path: str, rows: Iterable[tuple[str, RemainingForecast]]) -> int:
    """Write (request id, forecast) pairs as a replayable file; returns the rows written."""
    n = 0
    with open(path, "w") as f:
        for rid, fc in rows:
            f.write(json.dumps(forecast_row(rid, fc)) + "\n")
            n += 1
    return n


def forecasts_from_step_trace(
    path: str | Path, ids: dict[str, str] | None = None
) -> list[tuple[str, RemainingForecast]]:
    """The forecasts a live scheduler recorded in its step trace (`ALISE_STEP_TRACE`), in
    step order, keyed by `ids[request id]` (e.g. the trace's own id for the gateway's request
    id; requests not in `ids` are left out) or, with `ids` None, by the request id."""
    out = []
    for line in Path(path).read_text().splitlines():
        for rid, generated, q10, q50, q90, p_cap in json.loads(line).get("forecasts", ()):
            key = rid if ids is None else ids.get(rid)
            if key is not None:
                out.append((key, RemainingForecast(int(generated), q10, q50, q90, p_cap)))
    return out


def make_forecasts(spec: str | None, seed: int = 0) -> ForecastSource | None:
    if spec is None:
        return None
    kind, opts = parse_spec(spec)
    if kind == "synthetic" and set(opts) <= {"sigma", "floor", "every", "seed"}:
        return SyntheticForecasts(
            float(opts.get("sigma", 1.0)),
            float(opts.get("floor", 0.1)),
            int(opts.get("every", DEFAULT_EVERY)),
            int(opts.get("seed", seed)),
        )
    if kind == "replay" and "path" in opts:
        return ReplayForecasts(opts["path"])
    raise ValueError(
        f"bad forecast spec {spec!r}: synthetic[:sigma=S,floor=F,every=N,seed=K] | replay:PATH"
    )


def forecast_quality(
    items: list, source: ForecastSource, checkpoints: tuple[int, ...] = (1, 16, 32, 64)
) -> dict[str, dict[str, float]]:
    """How good a source's forecasts are on a trace, per checkpoint, over the requests still
    running there: Kendall tau of the median against the true remaining length, and the median
    relative error of the median (what the issue's probe is scored by)."""
    from scipy.stats import kendalltau

    out: dict[str, dict[str, float]] = {}
    for g in checkpoints:
        pred, true = [], []
        for item in items:
            if item.output_len > g:
                fc = source.at(item.sample_id or item.request_id, g, item.output_len, 1 << 30)
                if fc is not None:
                    pred.append(fc.q50)
                    true.append(item.output_len - fc.generated)  # counted as it was made
        if len(pred) > 1:
            rel = np.abs(np.asarray(pred) - np.asarray(true)) / np.asarray(true)
            out[str(g)] = {
                "n": len(pred),
                "kendall_tau": float(kendalltau(pred, true)[0]),
                "median_relative_error": float(np.median(rel)),
            }
    return out
