"""Arrival processes, as `vllm bench serve` draws them.

Inter-arrival gaps are gamma distributed with shape = burstiness and mean = 1/rate:
burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. A trace's own
timestamps can instead be shifted to start at 0 and stretched to a target mean rate.
"""

from __future__ import annotations

import numpy as np


def _check_rate(rate: float) -> None:
    if not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"rate must be a positive finite number of requests/s, got {rate}")


def gamma_arrivals(
    n: int, rate: float, burstiness: float = 1.0, seed: int = 0, start_s: float = 0.0
) -> list[float]:
    """n arrival times; the first request arrives after one gap (as vllm does)."""
    _check_rate(rate)
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return (start_s + np.cumsum(gaps)).tolist()


def poisson_arrivals(n: int, rate: float, seed: int = 0, start_s: float = 0.0) -> list[float]:
    return gamma_arrivals(n, rate, 1.0, seed, start_s)


def uniform_arrivals(n: int, rate: float) -> list[float]:
    """Evenly spaced arrivals (rate = inf is not allowed; use all-at-zero explicitly)."""
    _check_rate(rate)
    return [i / rate for i in range(n)]


def scale_timestamps(timestamps: list[float], target_rate: float | None = None) -> list[float]:
    """Shift to start at 0; with a target rate, stretch so that the mean rate
    (n - 1) / span equals it. Order is preserved; ties stay ties."""
    if not timestamps:
        return []
    ts = np.asarray(timestamps, dtype=float)
    if np.any(np.diff(ts) < 0):
        ts = np.sort(ts)
    ts = ts - ts[0]
    if target_rate is None or len(ts) < 2:
        return ts.tolist()
    _check_rate(target_rate)
    span = ts[-1]
    if span <= 0:
        raise ValueError("all timestamps are equal: cannot scale them to a rate")
    native_rate = (len(ts) - 1) / span
    return (ts * (native_rate / target_rate)).tolist()


def make_arrivals(
    n: int,
    process: str,
    rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    timestamps: list[float] | None = None,
) -> list[float]:
    """`poisson` | `gamma` | `uniform` | `trace` (the given timestamps scaled to `rate`)."""
    if process == "poisson":
        return poisson_arrivals(n, rate, seed)
    if process == "gamma":
        return gamma_arrivals(n, rate, burstiness, seed)
    if process == "uniform":
        return uniform_arrivals(n, rate)
    if process == "trace":
        if timestamps is None:
            raise ValueError("arrival process `trace` needs a trace with timestamps (csv:...)")
        return scale_timestamps(list(timestamps)[:n], rate)
    raise ValueError(f"unknown arrival process {process!r}: poisson, gamma, uniform, trace")
