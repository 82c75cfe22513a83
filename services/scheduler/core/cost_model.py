"""One cost model (docs/scheduling.md, "Cost model"): iteration time of a batch, fitted by least squares.

    iteration_time = c0 + c_prefill * P + c_decode * D + c_context * C [+ c_expert * X]

X (mixture-of-experts models only, `Experts`): the expert weight matrices a step reads, which
follow the experts its P + D tokens are routed to, not the model's total parameters.
P = prefill tokens (requests with more than one uncomputed token), D = decode tokens,
C = attention context = sum over scheduled requests of (computed + newly scheduled tokens),
i.e. the KV length each scheduled request reads. ALISE's per-request model is derived from it:
    T_pre(s) = s * t0                 (t0: least-squares slope of a lone prefill of s tokens)
    T_dec(s, n) = n * (alpha * s + beta)   (alpha = c_context, beta = c0 + c_decode)
Plain Python on purpose: the scheduler calls it on its hot path and the core stays dependency-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.scheduler.core.request import Request
    from services.scheduler.core.residual import Residuals
    from services.scheduler.core.shape import StepShape

Sample = dict[str, Any]  # one profiled batch: prefill/decode/context tokens and time_s
Profile = dict[str, Any]  # a saved profile (JSON object)
UNSET = math.nan  # a derived quantity not given: computed from the coefficients

COEFFS = ("c0", "c_prefill", "c_decode", "c_context")
_T0_GRID = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's routing, for what a step's expert weights cost."""

    num_experts: int  # per MoE layer
    top_k: int  # experts each token is routed to
    layers: int  # layers with experts

    def read(self, tokens: float) -> float:
        """Experts a step of `tokens` tokens reads, summed over the MoE layers, with tokens
        routed uniformly at random: layers x E x (1 - (1 - k/E)^tokens)."""
        if tokens <= 0 or self.num_experts <= 0:
            return 0.0
        miss: float = math.pow(1.0 - min(self.top_k, self.num_experts) / self.num_experts, tokens)
        return self.layers * self.num_experts * (1.0 - miss)

    def to_profile(self) -> dict[str, int]:
        return {"num_experts": self.num_experts, "top_k": self.top_k, "layers": self.layers}


@dataclass
class CostModel:
    c0: float
    c_prefill: float
    c_decode: float
    c_context: float = 0.0
    t0: float = UNSET
    alpha: float = UNSET
    beta: float = UNSET
    pivot_tokens: int = 0  # AccelGen S_pf: forward size that saturates compute
    pivot_time_s: float = UNSET  # AccelGen T_pf: iteration time at S_pf
    fit_error: float | None = None
    device: str = "unknown"
    model: str = "unknown"
    block_size: int | None = None
    num_device_blocks: int | None = None
    num_host_blocks: int | None = None
    experts: Experts | None = None  # mixture of experts: the c_expert term
    c_expert: float = 0.0  # seconds per expert weight read (Experts.read)
    samples: list[Sample] = field(default_factory=list, repr=False)
    _residuals: Residuals | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in COEFFS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"cost model coefficient {name} must be finite and >= 0, got {value!r}"
                )
        if self.c0 + self.c_prefill + self.c_decode <= 0:
            raise ValueError("cost model predicts zero time for every batch")
        if math.isnan(self.t0):
            grid = [(s, self.iteration_time(s, 0, s)) for s in _T0_GRID]
            self.t0 = sum(s * t for s, t in grid) / sum(s * s for s, _ in grid)
        if math.isnan(self.alpha):
            self.alpha = self.c_context
        if math.isnan(self.beta):
            self.beta = self.c0 + self.c_decode
        if self.pivot_tokens < 1:
            # compute time per token equals the fixed per-iteration (weight streaming) time
            per_token = self.c_prefill + self.c_context
            self.pivot_tokens = max(1, round(self.c0 / per_token)) if per_token > 0 else 512
        if math.isnan(self.pivot_time_s):
            self.pivot_time_s = self.iteration_time(self.pivot_tokens, 0, self.pivot_tokens)

    # -- batch time -------------------------------------------------------------------------
    def iteration_time(
        self, prefill_tokens: float, decode_tokens: float, context_tokens: float = 0
    ) -> float:
        if prefill_tokens == 0 and decode_tokens == 0:
            return 0.0
        return (
            self.c0
            + self.c_prefill * prefill_tokens
            + self.c_decode * decode_tokens
            + self.c_context * context_tokens
            + self._experts_time(prefill_tokens + decode_tokens)
        )

    def _experts_time(self, tokens: float) -> float:
        if self.experts is None or not self.c_expert:
            return 0.0
        return self.c_expert * self.experts.read(tokens)

    def measured_time(
        self, prefill_tokens: int, decode_tokens: int, context_tokens: int = 0
    ) -> float:
        """`iteration_time` corrected by the profile's measured samples nearest in shape (see
        core/residual.py): the simulator's clock. Equal to `iteration_time` without samples."""
        base = self.iteration_time(prefill_tokens, decode_tokens, context_tokens)
        if base == 0.0 or not self.samples:
            return base
        if self._residuals is None:
            from services.scheduler.core.residual import Residuals

            self._residuals = Residuals(self.samples, self.iteration_time)
        if not self._residuals:
            return base
        return base * self._residuals.ratio(prefill_tokens, decode_tokens, context_tokens)

    def step_time(self, shape: StepShape) -> float:
        """Iteration time of a step the core built (swaps are assumed overlapped with compute)."""
        return self.iteration_time(
            shape.num_prefill_tokens, shape.num_decode_tokens, shape.num_context_tokens
        )

    # -- ALISE per-request model ------------------------------------------------------------
    def prefill_time(self, s: int) -> float:
        return s * self.t0

    def decode_time(self, s: int, n: int) -> float:
        return n * (self.alpha * s + self.beta)

    def remaining_time(self, request: Request, predicted_len: int | None = None) -> float:
        """Estimated seconds of execution left for `request` if it outputs `predicted_len`
        tokens in total (default: its own prediction, else max_tokens)."""
        pred = predicted_len or request.predicted_len or request.max_tokens
        uncomputed = request.num_uncomputed_tokens
        left = pred - request.num_output_tokens
        t = 0.0
        if uncomputed > 1:
            t = uncomputed * self.t0
            left -= 1  # the prefill itself yields one token
        if left > 0:
            t += left * (self.alpha * (request.num_tokens + left / 2) + self.beta)
        return t

    # -- budgets ----------------------------------------------------------------------------
    def token_budget(
        self,
        tbt_s: float,
        tile_size: int = 1,
        decode_tokens: int = 0,
        context_tokens: int = 0,
        max_tokens: int = 1 << 16,
    ) -> int:
        """Largest token count whose iteration (a prefill chunk of that size alongside
        `decode_tokens` decodes with `context_tokens` of KV) stays within `tbt_s`, rounded down
        to a multiple of `tile_size` and at least one tile (Sarathi-Serve section 4.3)."""
        if tbt_s <= 0:
            raise ValueError(f"tbt_s must be > 0, got {tbt_s}")
        if self._experts_time(1):
            n = self._budget_by_search(tbt_s, decode_tokens, context_tokens, max_tokens)
        else:
            fixed = self.c0 + self.c_decode * decode_tokens + self.c_context * context_tokens
            per = self.c_prefill + self.c_context
            n = max_tokens if per <= 0 else int((tbt_s - fixed) / per) + decode_tokens
        n = min(n, max_tokens)
        return max(tile_size, (n // tile_size) * tile_size)

    def _budget_by_search(self, tbt_s: float, decodes: int, context: int, max_tokens: int) -> int:
        """token_budget with the (concave) expert term: the largest chunk m whose iteration
        beside the decodes fits, found by bisection (time grows with m); returns m + decodes."""
        lo, hi = 0, max(0, max_tokens - decodes)

        def fits(m: int) -> bool:
            return self.iteration_time(m, decodes, context + m) <= tbt_s

        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo + decodes

    def accelgen_budget(self, slo_min_s: float) -> int:
        """AccelGen eq. 6: S_b = S_pf * SLO_min / T_pf."""
        return max(1, int(self.pivot_tokens * slo_min_s / self.pivot_time_s))

    # -- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_profile(cls, source: Profile | str | Path) -> CostModel:
        profile: Profile = (
            source if isinstance(source, dict) else json.loads(Path(source).read_text())
        )
        coeffs = profile.get("coefficients")
        if not isinstance(coeffs, dict) or any(k not in coeffs for k in COEFFS):
            if profile.get("samples"):
                return cls.fit(profile["samples"], **_meta(profile))
            raise ValueError(f"profile needs 'coefficients' with {COEFFS} or 'samples'")
        c0, c_prefill, c_decode, c_context = (float(coeffs[k]) for k in COEFFS)
        return cls(
            c0,
            c_prefill,
            c_decode,
            c_context,
            **_alise(profile),
            **_meta(profile),
            c_expert=float(coeffs.get("c_expert", 0.0)),
            samples=list(profile.get("samples") or []),
        )

    def to_profile(self) -> Profile:
        return {
            "device": self.device,
            "model": self.model,
            "coefficients": {k: getattr(self, k) for k in COEFFS}
            | ({"c_expert": self.c_expert} if self.experts else {}),
            "moe": self.experts.to_profile() if self.experts else None,
            "t0": self.t0,
            "alpha": self.alpha,
            "beta": self.beta,
            "pivot_tokens": self.pivot_tokens,
            "pivot_time_s": self.pivot_time_s,
            "fit_error": self.fit_error,
            "samples": self.samples,
            "block_size": self.block_size,
            "num_device_blocks": self.num_device_blocks,
            "num_host_blocks": self.num_host_blocks,
        }

    @classmethod
    def fit(cls, samples: list[Sample], **meta: Any) -> CostModel:
        """Non-negative least squares over samples {prefill_tokens, decode_tokens,
        context_tokens, time_s}; fit_error is the relative RMSE."""
        from services.scheduler.core.lsq import nnls

        experts: Experts | None = meta.get("experts")
        rows, ys = _design(samples, experts)
        c0, c_prefill, c_decode, c_context, *c_expert = nnls(rows, ys)
        model = cls(
            c0, c_prefill, c_decode, c_context, samples=list(samples),
            c_expert=c_expert[0] if c_expert else 0.0, **meta,
        )  # fmt: skip
        model.fit_error = _relative_rmse(model, rows, ys)
        return model


def _design(
    samples: list[Sample], experts: Experts | None = None
) -> tuple[list[list[float]], list[float]]:
    """Rows [1, P, D, C] (and X = experts read, for a mixture of experts) and times."""
    if len(samples) < 4:
        raise ValueError(
            f"need at least 4 profile samples to fit 4 coefficients, got {len(samples)}"
        )
    rows: list[list[float]] = []
    ys: list[float] = []
    for i, s in enumerate(samples):
        try:
            p, d = float(s["prefill_tokens"]), float(s["decode_tokens"])
            c, t = float(s.get("context_tokens", 0)), float(s["time_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile sample {i} is malformed: {s!r}") from exc
        if t <= 0 or min(p, d, c) < 0:
            raise ValueError(f"profile sample {i} has a negative count or non-positive time: {s!r}")
        rows.append([1.0, p, d, c] + ([experts.read(p + d)] if experts else []))
        ys.append(t)
    return rows, ys


def _relative_rmse(model: CostModel, rows: list[list[float]], ys: list[float]) -> float:
    err = [(model.iteration_time(r[1], r[2], r[3]) - y) / y for r, y in zip(rows, ys)]
    return math.sqrt(sum(e * e for e in err) / len(err))


def _alise(profile: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("t0", "alpha", "beta", "pivot_time_s", "fit_error"):
        if profile.get(key) is not None:
            out[key] = float(profile[key])
    if profile.get("pivot_tokens") is not None:
        out["pivot_tokens"] = int(profile["pivot_tokens"])
    return out


def _meta(profile: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {k: str(profile[k]) for k in ("device", "model") if profile.get(k)}
    for key in ("block_size", "num_device_blocks", "num_host_blocks"):
        if profile.get(key) is not None:
            out[key] = int(profile[key])
    moe = profile.get("moe")
    if isinstance(moe, dict):
        out["experts"] = Experts(int(moe["num_experts"]), int(moe["top_k"]), int(moe["layers"]))
    return out


def roofline_profile(name: str) -> Profile:
    """Analytical profile for a named `gpu/model` (see core/roofline.py for the numbers)."""
    from services.scheduler.core.roofline import roofline_profile as _rp

    return _rp(name)
