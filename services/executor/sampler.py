"""Token sampling: penalties and logit bias, greedy, temperature, top-k, top-p, min-p,
per-request seed; token + logprob.

The logprob reported is the token's log-probability under the model's raw distribution
(log_softmax of the logits, before temperature/top-k/top-p), as OpenAI-style APIs report it.
A seeded request draws its k-th output token from a generator seeded with (seed, k), so the
same seed gives the same text whether or not the request was preempted and recomputed.
Rows whose parameters adjust the logits (`SamplingParams.adjusts_logits`) get, in vLLM's
order: logit bias, repetition penalty (prompt and output tokens: positive logits divided,
negative multiplied), frequency and presence penalties (output tokens: minus penalty x count,
minus penalty once), vLLM's bad words (the last token of a bad word is banned where the output
ends with the rest of it), then temperature, top-k, top-p and min-p; greedy rows take the argmax of
the adjusted logits. `top_alternatives` gives the rows that ask (`top_logprobs`) their most
likely tokens under the same raw distribution, in one top-k over those rows.
"""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] / temperature with everything outside top-k / top-p set to -inf."""
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


def _adjust(logits: torch.Tensor, p: SamplingParams, tokens: list[int], n_out: int) -> torch.Tensor:
    """logits [V] with the bias and penalties of `p`; tokens = prompt + output so far."""
    x = logits.clone()
    vocab = x.shape[-1]
    for token, bias in p.logit_bias:
        if token < vocab:
            x[token] += bias
    if p.repetition_penalty != 1.0 and tokens:
        seen = torch.tensor(sorted(set(tokens)), device=x.device)
        picked = x[seen]
        x[seen] = torch.where(
            picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
        )
    output = tokens[len(tokens) - n_out :] if n_out else []
    for word in p.bad_words:  # ban the token that would complete a bad word
        head = list(word[:-1])
        if word[-1] < vocab and (not head or output[len(output) - len(head) :] == head):
            x[word[-1]] = float("-inf")
    if (p.frequency_penalty or p.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=x.device), minlength=vocab)[:vocab]
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def _min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(x, dim=-1)
    return x.masked_fill(probs < min_p * probs.max(), float("-inf"))


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


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Exponential-race sampling: argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


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
    tokens = torch.argmax(logits, dim=-1).tolist()  # greedy default
    for i, p in enumerate(params):
        row = logits[i]
        if p.adjusts_logits:
            row = _adjust(row, p, histories[i] if histories else [], output_index[i])
            if p.greedy:
                tokens[i] = int(torch.argmax(row if not p.min_p else _min_p(row, p.min_p)))
                continue
        elif p.greedy:
            continue
        if probs is not None and _raw(p, row.shape[-1]):
            row_probs = probs[i]
        else:
            x = _filter(row, p)
            row_probs = torch.softmax(_min_p(x, p.min_p) if p.min_p else x, dim=-1)
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed((p.seed * 1_000_003 + output_index[i]) % (2**63))
        tokens[i] = _draw(row_probs, gen)
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


# -- batched sampling (CUDA): one filter pass over the batch, one packed result ----------------


def allowed_mask(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """bool [S, V]: the tokens each row may draw after temperature, top-k, top-p and min-p,
    the same sets as `_filter` and `_min_p` row by row, in one sort over the batch.
    x [S, V]: the (adjusted) logits. Greedy rows take their argmax, which every filter keeps."""
    dev, vocab = x.device, x.shape[-1]
    rows = [
        (
            1.0 if p.greedy else p.temperature,
            p.top_k if 0 < p.top_k < vocab else vocab,
            p.top_p if 0 < p.top_p < 1 else 2.0,  # >1: never drops a token
            p.min_p,
        )
        for p in params
    ]
    knobs = torch.tensor(rows, dtype=torch.float32).to(dev, non_blocking=True)  # [S, 4]
    z = x / knobs[:, 0:1]
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    kth = sorted_z.gather(1, knobs[:, 1:2].long() - 1)  # [S, 1]
    keep = sorted_z >= kth  # top-k, ties kept (as `x < kth` masking)
    probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs.cumsum(-1) - probs < knobs[:, 2:3]  # top-p: the first token always stays
    probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs >= knobs[:, 3:4] * probs[:, :1]  # min-p against the most likely token
    return torch.zeros_like(keep).scatter_(1, order, keep)


def _noise(
    shape: torch.Size,
    device: torch.device,
    params: list[SamplingParams],
    output_index: list[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Exp(1) noise [S, V]: unseeded rows from the default generator in one call, a seeded
    row from `generator` seeded with (seed, output index), so its draw depends on nothing else
    in the batch."""
    noise = torch.empty(shape, device=device).exponential_()
    for i, p in enumerate(params):
        if p.seed is not None and not p.greedy:
            gen = generator or torch.Generator(device=device)
            gen.manual_seed((p.seed * 1_000_003 + output_index[i]) % (2**63))
            noise[i].exponential_(generator=gen)
    return noise


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
    with `unpack_samples` after one device-to-host copy. Penalties and biases are applied row
    by row (rare); everything else is one pass over the batch."""
    logprobs = torch.log_softmax(logits, dim=-1)  # under the raw distribution
    x = logits
    adjust = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjust:
        x = logits.clone()
        for i in adjust:
            x[i] = _adjust(logits[i], params[i], histories[i] if histories else [], output_index[i])
    tokens = torch.argmax(x, dim=-1)
    if not all(p.greedy for p in params):
        keep = allowed_mask(x, params)
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
        z = (x / temps.to(x.device, non_blocking=True)[:, None]).masked_fill(~keep, float("-inf"))
        noise = _noise(z.shape, z.device, params, output_index, generator)
        drawn = torch.argmax(torch.softmax(z, dim=-1) / noise, dim=-1)
        greedy = torch.tensor([p.greedy for p in params]).to(x.device, non_blocking=True)
        tokens = torch.where(greedy, tokens, drawn)
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
