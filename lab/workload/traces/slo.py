"""SLO assignment schemes.

- `none`: no objectives.
- `uniform` (Sarathi-Serve): one TBT target for every request (and optionally one TTFT).
- `heterogeneous` (AccelGen section 3): TTFT = U[0.5, 1.5] x the mean profiled prefill time of
  the request's 512-token prompt-length group; TBT = 0.1875 s x a scale drawn from a set
  (default {0.25, 0.5, 1, 2}).
- any scheme + `jct_share`: that share of requests is "offline": it carries only a JCT
  deadline = U[jct_min, jct_max] x (prefill time + output_len x 0.1875 s) instead.

`prefill_time` is a callable prompt_len -> seconds (the cost model's, for instance), so this
module stays free of the simulator.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from lab.workload.traces.trace import SloSpec, TraceItem

READING_TBT_S = 0.1875  # AccelGen's normal reading speed, seconds per token
SCHEMES = ("none", "uniform", "heterogeneous")


def _group_prefill_means(
    items: list[TraceItem], prefill_time: Callable[[int], float], group_tokens: int
) -> dict[int, float]:
    groups: dict[int, list[float]] = defaultdict(list)
    for item in items:
        groups[item.prompt_len // group_tokens].append(prefill_time(item.prompt_len))
    return {g: float(np.mean(v)) for g, v in groups.items()}


def _jct_deadline(item: TraceItem, prefill_time, rng, jct_range) -> float:
    ideal = prefill_time(item.prompt_len) + item.output_len * READING_TBT_S
    return float(rng.uniform(*jct_range) * ideal)


def assign_slos(
    items: list[TraceItem],
    scheme: str = "none",
    *,
    seed: int = 0,
    tbt_s: float = READING_TBT_S,
    ttft_s: float | None = None,
    prefill_time: Callable[[int], float] | None = None,
    ttft_scale: tuple[float, float] = (0.5, 1.5),
    tbt_scales: Sequence[float] = (0.25, 0.5, 1.0, 2.0),
    group_tokens: int = 512,
    jct_share: float = 0.0,
    jct_range: tuple[float, float] = (1.0, 2.0),
) -> list[TraceItem]:
    """A copy of `items` with SLOs assigned by `scheme` (deterministic given `seed`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown SLO scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    if not 0.0 <= jct_share <= 1.0:
        raise ValueError(f"jct_share must be in [0, 1], got {jct_share}")
    needs_prefill = scheme == "heterogeneous" or jct_share > 0
    if needs_prefill and prefill_time is None:
        raise ValueError(
            f"SLO scheme {scheme!r} (or jct_share > 0) needs a prefill_time "
            "function (the profiled prefill latency)"
        )
    rng = np.random.default_rng(seed)
    groups = (
        _group_prefill_means(items, prefill_time, group_tokens) if scheme == "heterogeneous" else {}
    )
    out = []
    for item in items:
        if jct_share > 0 and rng.random() < jct_share:
            slo = SloSpec(deadline_s=_jct_deadline(item, prefill_time, rng, jct_range))
        elif scheme == "uniform":
            slo = SloSpec(ttft_s=ttft_s, tbt_s=tbt_s)
        elif scheme == "heterogeneous":
            base = groups[item.prompt_len // group_tokens]
            slo = SloSpec(
                ttft_s=float(rng.uniform(*ttft_scale) * base),
                tbt_s=float(READING_TBT_S * rng.choice(np.asarray(tbt_scales))),
            )
        else:
            slo = SloSpec()
        out.append(item.with_slo(slo))
    return out
