"""Serving metrics: ONE definition for the simulator, the live benchmark and the services.

Everything is computed from per-request records (arrival, first scheduled, the time of each
output token, the request's SLO) and, for utilisation, per-iteration records. Times are
seconds. Definitions (docs/workloads.md, "Metrics"):

- TTFT = first token - arrival; TBT = gaps between consecutive tokens of one request (pooled
  over requests for percentiles, as vLLM's ITL); TPOT = (E2E - TTFT) / (output_len - 1);
  E2E = finish - arrival; normalized latency = E2E / output_len (ALISE); scheduling delay =
  first scheduled - arrival.
- goodput (`vllm bench serve --goodput` semantics, per-request SLOs): completed requests/s
  whose TTFT <= ttft SLO, TPOT <= tbt SLO and E2E <= deadline, for each SLO they carry;
  `slo_attainment` is the same test as a fraction of all requests.
- iteration SLO attainment (AccelGen): over every token of every request with an SLO, the
  share whose latency met its iteration objective (first token: TTFT SLO; later tokens: the
  gap to the previous token vs the TBT SLO). JCT attainment: share of deadline requests
  finishing in time.
- KV utilisation: time-weighted mean of the used share of device KV blocks over iterations;
  compute utilisation: mean over iterations of scheduled tokens / token budget (capped at 1),
  the budget being a reference forward size when given (the profile's pivot, AccelGen's S_pf)
  and each iteration's own budget for `budget_utilization`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)  # absolute time of each token
    first_scheduled_s: float | None = None
    finish_s: float | None = None  # default: the last token's time
    completed: bool = True  # False: aborted / failed (excluded from latency, never "good")
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    slo_deadline_s: float | None = None  # relative to arrival
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (live: the usage's)

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def end_s(self) -> float | None:
        if self.finish_s is not None:
            return self.finish_s
        return self.token_times[-1] if self.token_times else None

    @property
    def has_slo(self) -> bool:
        return any(v is not None for v in (self.slo_ttft_s, self.slo_tbt_s, self.slo_deadline_s))


@dataclass
class IterationRecord:
    start_s: float
    end_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    kv_utilization: float  # used share of device KV blocks after scheduling, 0..1
    token_budget: int | None = None
    num_requests: int = 0
    num_preempted: int = 0
    num_swap_out_blocks: int = 0
    num_swap_in_blocks: int = 0
    executor: str = "0"

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


# --- per-request metrics --------------------------------------------------------------


def ttft(r: RequestRecord) -> float | None:
    return r.token_times[0] - r.arrival_s if r.token_times else None


def tbts(r: RequestRecord) -> list[float]:
    return np.diff(r.token_times).tolist() if len(r.token_times) > 1 else []


def tpot(r: RequestRecord) -> float | None:
    if r.output_len < 2:
        return None
    return (r.token_times[-1] - r.token_times[0]) / (r.output_len - 1)


def e2e(r: RequestRecord) -> float | None:
    return None if r.end_s is None else r.end_s - r.arrival_s


def normalized_latency(r: RequestRecord) -> float | None:
    latency = e2e(r)
    return None if latency is None or r.output_len == 0 else latency / r.output_len


def scheduling_delay(r: RequestRecord) -> float | None:
    return None if r.first_scheduled_s is None else r.first_scheduled_s - r.arrival_s


def meets_slo(r: RequestRecord) -> bool:
    """Every SLO the request carries holds (vLLM goodput: ttft, tpot, e2el)."""
    if not r.completed or not r.token_times:
        return False
    checks = ((r.slo_ttft_s, ttft(r)), (r.slo_tbt_s, tpot(r)), (r.slo_deadline_s, e2e(r)))
    return all(value is None or slo is None or value <= slo for slo, value in checks)


def iteration_slo_hits(r: RequestRecord) -> tuple[int, int]:
    """(tokens that met their iteration objective, tokens with an objective)."""
    met = total = 0
    if r.slo_ttft_s is not None and r.token_times:
        total, met = 1, int(ttft(r) <= r.slo_ttft_s)
    if r.slo_tbt_s is not None:
        gaps = tbts(r)
        total += len(gaps)
        met += sum(g <= r.slo_tbt_s for g in gaps)
    return met, total


# --- aggregates -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default, as vLLM); None when empty."""
    return float(np.percentile(values, q)) if len(values) else None


def mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _describe(name: str, values: list[float], out: dict) -> None:
    out[f"mean_{name}"] = mean(values)
    for q in PERCENTILES:
        out[f"{'median' if q == 50 else f'p{q}'}_{name}"] = percentile(values, q)


def kv_utilization(iterations: Sequence[IterationRecord]) -> float | None:
    weights = [max(it.end_s - it.start_s, 0.0) for it in iterations]
    if not iterations or sum(weights) <= 0:
        return None
    return float(np.average([it.kv_utilization for it in iterations], weights=weights))


def compute_utilization(
    iterations: Sequence[IterationRecord], reference_tokens: int | None = None
) -> float | None:
    """Mean over iterations of min(1, tokens / budget): the budget is `reference_tokens` when
    given (e.g. the profile's pivot forward size, comparable across policies), else each
    iteration's own token budget (iterations without one are skipped)."""
    shares = [
        min(it.num_tokens / b, 1.0)
        for it in iterations
        if (b := reference_tokens or it.token_budget)
    ]
    return mean(shares)


def duration(records: Sequence[RequestRecord]) -> float:
    """First arrival to last finish (the benchmark's makespan)."""
    ends = [r.end_s for r in records if r.end_s is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.arrival_s for r in records)


def summarize(
    records: Iterable[RequestRecord],
    iterations: Sequence[IterationRecord] = (),
    duration_s: float | None = None,
    reference_tokens: int | None = None,
) -> dict:
    records = list(records)
    done = [r for r in records if r.completed and r.token_times]
    span = duration(records) if duration_s is None else duration_s
    per_s = (lambda x: x / span) if span > 0 else (lambda x: None)
    out = {
        "num_requests": len(records),
        "completed": len(done),
        "duration_s": span,
        "request_throughput": per_s(len(done)),
        "throughput_tok_s": per_s(sum(r.output_len for r in done)),
        "total_throughput_tok_s": per_s(sum(r.output_len + r.prompt_len for r in done)),
    }
    for name, fn in (
        ("ttft", ttft),
        ("tpot", tpot),
        ("e2e", e2e),
        ("normalized_latency", normalized_latency),
        ("scheduling_delay", scheduling_delay),
    ):
        _describe(name, [v for r in done if (v := fn(r)) is not None], out)
    _describe("tbt", [g for r in done for g in tbts(r)], out)
    good = sum(meets_slo(r) for r in records)
    out["goodput"] = per_s(good)
    out["slo_attainment"] = good / len(records) if records else None
    hits = [iteration_slo_hits(r) for r in records]
    total = sum(t for _, t in hits)
    out["iteration_slo_attainment"] = sum(m for m, _ in hits) / total if total else None
    jct = [r for r in records if r.slo_deadline_s is not None]
    out["jct_slo_attainment"] = (sum(meets_slo(r) for r in jct) / len(jct)) if jct else None
    out["num_preemptions"] = sum(r.num_preemptions for r in records)
    prompt = sum(r.prompt_len for r in done)
    out["prefix_cache_hit_rate"] = sum(r.cached_tokens for r in done) / prompt if prompt else None
    out["num_iterations"] = len(iterations)
    out["kv_utilization"] = kv_utilization(iterations)
    out["compute_utilization"] = compute_utilization(iterations, reference_tokens)
    out["budget_utilization"] = compute_utilization(iterations)
    return out
