"""Token sampling: greedy, temperature, top-k, top-p, per-request seed; token + logprob.

The logprob reported is the token's log-probability under the model's raw distribution
(log_softmax of the logits, before temperature/top-k/top-p), as OpenAI-style APIs report it.
A seeded request draws its k-th output token from a generator seeded with (seed, k), so the
same seed gives the same text whether or not the request was preempted and recomputed.
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


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Exponential-race sampling: argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
) -> tuple[list[int], list[float]]:
    """logits [S, V] fp32 -> (token ids, logprobs); output_index[i] = tokens already output."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, V]
    tokens = torch.argmax(logits, dim=-1).tolist()  # greedy default
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(_filter(logits[i], p), dim=-1)
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed((p.seed * 1_000_003 + output_index[i]) % (2**63))
        tokens[i] = _draw(probs, gen)
    index = torch.tensor(tokens, device=logits.device)[:, None]
    return tokens, logprobs.gather(1, index).squeeze(1).tolist()
