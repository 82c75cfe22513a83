"""Token sampling: penalties and logit bias, greedy, temperature, top-k, top-p, min-p,
per-request seed; token + logprob.

The logprob reported is the token's log-probability under the model's raw distribution
(log_softmax of the logits, before temperature/top-k/top-p), as OpenAI-style APIs report it.
A seeded request draws its k-th output token with a uniform number from a generator seeded
with (seed, k), so the same seed gives the same text whether or not the request was
preempted and recomputed, and whatever else is in the batch.

Rows whose parameters adjust the logits (`SamplingParams.adjusts_logits`) get their bias and
penalties batched (logit_adjust.py); then temperature, top-k, top-p and min-p; greedy rows take
the argmax of the adjusted logits (min-p never drops it). What a step costs follows what its
rows ask (vLLM's sampler does the same):
- greedy rows: one argmax over those rows;
- a row at temperature 1 with no filter or penalty draws from the raw distribution, the
  exponential of the log_softmax every row has anyway (or the caller's `probs`);
- other temperatures: one softmax; min-p: a comparison with the row's largest probability;
- top-k alone: a partial top-k; top-p: the top TOP_P_CANDIDATES tokens first, a full sort only
  for the rows whose top-p mass lies beyond them. No row is sorted that does not ask.
The draw is inverse-CDF: one uniform number per row against the row's cumulative
probabilities (one cumsum), not a noise value per vocabulary entry.
`top_alternatives` gives the rows that ask (`top_logprobs`) their most likely tokens under the
same raw distribution, in one top-k over those rows.
"""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from services.executor.logit_adjust import adjust_logits

TOP_P_CANDIDATES = 256  # top-p looks at this many best tokens before sorting a whole row


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] / temperature with everything outside top-k / top-p set to -inf (the
    row-by-row reference of allowed_mask)."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0 < p.top_p < 1:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= p.top_p  # keep the first token always
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def _min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(x, dim=-1)
    return x.masked_fill(probs < min_p * probs.max(), float("-inf"))


def _adjust(logits: torch.Tensor, p: SamplingParams, tokens: list[int], n_out: int) -> torch.Tensor:
    """One row's bias and penalties (logit_adjust.adjust_logits on that row)."""
    return adjust_logits(logits[None], [p], [tokens], [n_out])[0]


def _raw(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampled row draws from the model's raw distribution: temperature 1, no
    top-k, top-p or min-p, no bias or penalty."""
    return (
        not p.adjusts_logits
        and p.temperature == 1.0
        and not (p.top_k and p.top_k < vocab)
        and not 0 < p.top_p < 1
        and not p.min_p
    )


# -- which tokens a row may draw ---------------------------------------------------------------


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows` (t itself when they are all of its rows, in order)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, _index(rows, t.device))


def _temperatures(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    temps = [1.0 if p.greedy else p.temperature for p in params]
    return torch.tensor(temps, dtype=torch.float32).to(device, non_blocking=True)[:, None]


def allowed_mask(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """bool [S, V]: the tokens each row may draw after temperature, top-k, top-p and min-p,
    the same sets as `_filter` and `_min_p` row by row. x [S, V]: the (adjusted) logits.
    Rows that ask for no filter, and greedy rows (their argmax: every filter keeps it),
    allow every token."""
    return _scaled_mask(x / _temperatures(params, x.device), params)


def _scaled_mask(z: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """allowed_mask of logits already divided by their temperatures: each kind of filter on
    the rows that ask for it, no sort for the others."""
    vocab = z.shape[-1]
    keep = torch.ones(z.shape, dtype=torch.bool, device=z.device)
    live = [(i, p) for i, p in enumerate(params) if not p.greedy]
    top_p = [i for i, p in live if 0 < p.top_p < 1]
    top_k = [i for i, p in live if 0 < p.top_k < vocab and i not in top_p]
    min_p = [i for i, p in live if p.min_p and i not in top_p and i not in top_k]
    for rows, kind in ((top_p, _top_p_mask), (top_k, _top_k_mask), (min_p, _top_k_mask)):
        if rows:
            idx = _index(rows, z.device)
            keep.index_copy_(0, idx, kind(z.index_select(0, idx), [params[i] for i in rows]))
    return keep


def _top_k_mask(z: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k (ties with the k-th kept) by a partial top-k, then min-p; no sort."""
    vocab = z.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    keep = torch.ones(z.shape, dtype=torch.bool, device=z.device)
    if min(ks) < vocab:
        values = torch.topk(z, max(ks), dim=-1).values
        kth = values.gather(1, torch.tensor(ks, device=z.device)[:, None] - 1)
        keep = z >= kth
    if any(p.min_p for p in params):
        probs = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        floor = torch.tensor([p.min_p for p in params], device=z.device)[:, None]
        keep &= probs >= floor * probs.amax(dim=-1, keepdim=True)
    return keep


def _top_p_mask(z: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, top-p and min-p over the best TOP_P_CANDIDATES tokens of each row (one partial
    top-k); the rows whose top-p mass lies beyond them are sorted whole."""
    vocab = z.shape[-1]
    n = min(vocab, max([TOP_P_CANDIDATES] + [p.top_k for p in params if 0 < p.top_k < vocab]))
    values, order = torch.topk(z, n, dim=-1)  # sorted, best first
    keep, reached = _sorted_keep(values, z, params)
    mask = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(1, order, keep)
    if n < vocab and not bool(reached.all()):
        rows = (~reached).nonzero().flatten()
        sub = [params[i] for i in rows.tolist()]
        whole, order = torch.sort(z.index_select(0, rows), dim=-1, descending=True)
        keep, _ = _sorted_keep(whole, z.index_select(0, rows), sub)
        mask.index_copy_(0, rows, torch.zeros_like(keep).scatter_(1, order, keep))
    return mask


def _sorted_keep(
    values: torch.Tensor, z: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the best tokens `values` [R, n] of rows z [R, V] (sorted, best first): which to
    keep after top-k, top-p and min-p, and per row whether the decision is complete within
    them (top-k restricts to them, or the top-p mass is reached)."""
    vocab, n, dev = z.shape[-1], values.shape[-1], z.device
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    kth = values.gather(1, (ks.clamp(max=n) - 1)[:, None])
    keep = values >= kth  # top-k, ties kept
    restricted = (ks <= n)[:, None]
    # probabilities: over the top-k where it restricts, else over the whole row
    lse = torch.where(
        restricted,
        torch.logsumexp(values.masked_fill(~keep, float("-inf")), -1, keepdim=True),
        torch.logsumexp(z, -1, keepdim=True),
    )
    probs = torch.exp(values - lse).masked_fill(~keep, 0.0)
    cum = probs.cumsum(-1)
    top_p = torch.tensor([p.top_p if 0 < p.top_p < 1 else 2.0 for p in params], device=dev)
    keep &= cum - probs < top_p[:, None]  # the first token always stays
    floor = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    keep &= probs >= floor * probs[:, :1]  # min-p against the most likely token
    reached = restricted.squeeze(1) | (cum[:, -1] >= top_p) | (n == vocab)
    return keep, reached


# -- probabilities and the draw ------------------------------------------------------------------


def _probabilities(
    x: torch.Tensor,
    logprobs: torch.Tensor,
    probs: torch.Tensor | None,
    params: list[SamplingParams],
    rows: list[int],
) -> torch.Tensor:
    """[R, V] the distributions rows `rows` draw from: the raw distribution (the caller's
    `probs`, else exp(logprobs)) for temperature-1 rows without filter or penalty; the
    softmax of the filtered, temperature-scaled adjusted logits for the others."""
    vocab = x.shape[-1]
    raw = [i for i in rows if _raw(params[i], vocab)]
    if raw == rows:
        return _take(probs, rows) if probs is not None else _take(logprobs, rows).exp()
    scaled = [i for i in rows if i not in raw]
    sub = [params[i] for i in scaled]
    z = _take(x, scaled) / _temperatures(sub, x.device)
    filtered = torch.softmax(z.masked_fill(~_scaled_mask(z, sub), float("-inf")), dim=-1)
    if not raw:
        return filtered
    out = torch.empty((len(rows), vocab), dtype=filtered.dtype, device=x.device)
    at = {i: j for j, i in enumerate(rows)}
    raw_probs = _take(probs, raw) if probs is not None else _take(logprobs, raw).exp()
    out.index_copy_(0, _index([at[i] for i in raw], x.device), raw_probs.to(out.dtype))
    out.index_copy_(0, _index([at[i] for i in scaled], x.device), filtered)
    return out


def _uniforms(
    params: list[SamplingParams],
    rows: list[int],
    output_index: list[int],
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[R] uniform numbers in [0, 1): unseeded rows from the default generator in one call, a
    seeded row from a generator seeded with (seed, output index), so its draw depends on
    nothing else in the batch."""
    u = torch.rand(len(rows), device=device)
    for j, i in enumerate(rows):
        p = params[i]
        if p.seed is not None:
            gen = generator or torch.Generator(device=device)
            gen.manual_seed((p.seed * 1_000_003 + output_index[i]) % (2**63))
            u[j] = torch.rand(1, generator=gen, device=device)[0]
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] token ids: the first whose cumulative probability exceeds u x the row's total (a
    zero-probability token is never the first; the target stays below the total). A row with
    nothing left (a guide that allows no token) gives its last token, as greedy's argmax of
    such a row gives its first: never an index past the vocabulary."""
    cum = probs.cumsum(-1)
    total = cum[:, -1:]
    target = torch.minimum(u[:, None].to(cum.dtype) * total, torch.nextafter(total, total * 0))
    index = torch.searchsorted(cum, target, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


# -- the two entry points -------------------------------------------------------------------------


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_index: list[int],
    histories: list[list[int]] | None = None,
    logprobs: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
) -> tuple[list[int], list[float]]:
    """logits [S, V] fp32 -> (token ids, logprobs); output_index[i] = tokens already output;
    histories[i] = the row's prompt + output tokens (needed by penalties); logprobs and
    probs: the rows' log_softmax and its exp when the caller has them already (the probe's
    statistics); a row sampled from the raw distribution (temperature 1, no filter, no
    penalty) draws from its `probs` row instead of a softmax of its own."""
    if logprobs is None:
        logprobs = torch.log_softmax(logits, dim=-1)  # [S, V]
    x = adjust_logits(logits, params, histories, output_index)
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        for i, t in zip(greedy, torch.argmax(_take(x, greedy), dim=-1).tolist(), strict=True):
            tokens[i] = t
    if drawn:
        dist = _probabilities(x, logprobs, probs, params, drawn)
        u = _uniforms(params, drawn, output_index, logits.device)
        for i, t in zip(drawn, _inverse_cdf(dist, u).tolist(), strict=True):
            tokens[i] = t
    index = torch.tensor(tokens, device=logits.device)[:, None]
    return tokens, logprobs.gather(1, index).squeeze(1).tolist()


def top_alternatives(
    logits: torch.Tensor, params: list[SamplingParams]
) -> list[list[tuple[int, float]]]:
    """The `top_logprobs` most likely (token id, logprob) of each row that asks, best first
    (an empty list for the others); logits [S, V] fp32."""
    rows = [i for i, p in enumerate(params) if p.top_logprobs]
    out: list[list[tuple[int, float]]] = [[] for _ in params]
    if not rows:
        return out
    k = max(params[i].top_logprobs for i in rows)
    picked = torch.log_softmax(logits[rows], dim=-1)  # [R, V]
    values, ids = torch.topk(picked, min(k, picked.shape[-1]), dim=-1)  # [R, k]
    for j, i in enumerate(rows):
        n = params[i].top_logprobs
        out[i] = list(zip(ids[j, :n].tolist(), values[j, :n].tolist()))
    return out


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_index: list[int],
    histories: list[list[int]] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`sample` and `top_alternatives` on the logits' device without a host round trip:
    float64 [S, 2 + 2k] = (token, logprob, k alternative ids, k alternative logprobs), k the
    largest `top_logprobs` asked (rows asking fewer, or none, hold unused columns). Read it
    with `unpack_samples` after one device-to-host copy. `generator`: the device's generator
    that seeded rows re-seed."""
    logprobs = torch.log_softmax(logits, dim=-1)  # under the raw distribution
    x = adjust_logits(logits, params, histories, output_index)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    tokens = torch.argmax(x, dim=-1) if len(drawn) < len(params) else None
    if drawn:
        dist = _probabilities(x, logprobs, None, params, drawn)
        picked = _inverse_cdf(dist, _uniforms(params, drawn, output_index, x.device, generator))
        at = _index(drawn, x.device)
        tokens = picked if tokens is None else tokens.index_copy(0, at, picked)
    assert tokens is not None
    k = max((p.top_logprobs for p in params), default=0)
    out = torch.zeros((len(params), 2 + 2 * k), dtype=torch.float64, device=logits.device)
    out[:, 0] = tokens
    out[:, 1] = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if k:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        out[:, 2 : 2 + ids.shape[1]] = ids
        out[:, 2 + k : 2 + k + ids.shape[1]] = values
    return out


def unpack_samples(
    packed: list[list[float]], params: list[SamplingParams]
) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """The host rows of `sample_batch` -> (tokens, logprobs, top alternatives per row)."""
    k = (len(packed[0]) - 2) // 2 if packed else 0
    tokens = [int(row[0]) for row in packed]
    logprobs = [row[1] for row in packed]
    tops = [
        [(int(row[2 + j]), row[2 + k + j]) for j in range(p.top_logprobs)] if p.top_logprobs else []
        for row, p in zip(packed, params)
    ]
    return tokens, logprobs, tops
