"""Logit bias and penalties of a sampling batch, batched over the rows that ask (vLLM's order):
logit bias, repetition penalty (prompt and output tokens: positive logits divided, negative
multiplied), vLLM's bad words (the last token of a bad word is banned where the output ends
with the rest of it), frequency and presence penalties (output tokens: minus penalty x count,
minus penalty once). One scatter per kind over the rows that use it, not one Python pass per
row and token; bad words (rare, a few tokens each) row by row."""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams


def _counts(rows_tokens: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """float [R, V]: how often each token occurs in each row's list (ids past the vocabulary
    ignored)."""
    width = max((len(t) for t in rows_tokens), default=0)
    ids = torch.full((len(rows_tokens), width), vocab, dtype=torch.long)
    for r, tokens in enumerate(rows_tokens):
        ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    ids = ids.clamp_(max=vocab).to(device)  # `vocab`: padding, counted in a spare column
    counts = torch.zeros((len(rows_tokens), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def adjust_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int]] | None,
    output_index: list[int],
) -> torch.Tensor:
    """logits [S, V] with each row's bias and penalties applied (a copy), or `logits` itself
    when no row adjusts. histories[i]: the row's prompt + output tokens; output_index[i]:
    how many of them are output."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    x, vocab, dev = logits.clone(), logits.shape[-1], logits.device
    hist = histories or [[] for _ in params]
    bias = [(i, t, b) for i in rows for t, b in params[i].logit_bias if t < vocab]
    if bias:
        r, t, b = (list(v) for v in zip(*bias, strict=True))
        idx = (torch.tensor(r, device=dev), torch.tensor(t, device=dev))
        x.index_put_(idx, torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)
    rep = [i for i in rows if params[i].repetition_penalty != 1.0 and hist[i]]
    if rep:
        seen = _counts([hist[i] for i in rep], vocab, dev) > 0
        pen = torch.tensor([params[i].repetition_penalty for i in rep], device=dev)[:, None]
        sub = x[rep]
        x[rep] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    outputs = {i: _output(hist[i], output_index[i]) for i in rows}
    for i in rows:
        _ban_bad_words(x[i], params[i], outputs[i])
    fp = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
    fp = [i for i in fp if outputs[i]]
    if fp:
        counts = _counts([outputs[i] for i in fp], vocab, dev)
        freq = torch.tensor([params[i].frequency_penalty for i in fp], device=dev)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in fp], device=dev)[:, None]
        x[fp] -= freq * counts + pres * (counts > 0).to(x.dtype)
    return x


def _output(tokens: list[int], n_out: int) -> list[int]:
    return tokens[len(tokens) - n_out :] if n_out else []


def _ban_bad_words(row: torch.Tensor, p: SamplingParams, output: list[int]) -> None:
    """-inf (in place) on the token that would complete one of the row's bad words."""
    for word in p.bad_words:
        head = list(word[:-1])
        if word[-1] < row.shape[-1] and (not head or output[len(output) - len(head) :] == head):
            row[word[-1]] = float("-inf")
