"""The sampler's batched paths (services/executor/sampler.py, logit_adjust.py): filters that
sort only the rows asking for top-p (and only past the best candidates when the mass lies
beyond them), penalties batched over rows, the inverse-CDF draw."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling import SamplingParams
from services.executor.logit_adjust import adjust_logits
from services.executor.sampler import (
    TOP_P_CANDIDATES,
    _filter,
    _min_p,
    allowed_mask,
    sample,
    sample_batch,
)

VOCAB = 3000  # more than TOP_P_CANDIDATES: a flat row's top-p mass lies past them


def _logits(rows: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


MIXED = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=40),
    SamplingParams(temperature=1.0, top_k=400, top_p=0.5),
    SamplingParams(temperature=0.7, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=1.5, top_k=1),
]


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat (sorted whole) to peaked
def test_batched_mask_equals_the_row_filters(scale):
    assert VOCAB > TOP_P_CANDIDATES
    logits = _logits(len(MIXED), scale, seed=int(scale * 10))
    mask = allowed_mask(logits, MIXED)
    for i, p in enumerate(MIXED):
        if p.greedy:
            assert mask[i].all()
            continue
        x = _filter(logits[i], p)
        if p.min_p:
            x = _min_p(x, p.min_p)
        assert torch.equal(mask[i], x > float("-inf")), (scale, p)


def _row_reference(row: torch.Tensor, p: SamplingParams, tokens: list[int], n_out: int):
    """The penalties one row at a time, as the API documents them."""
    x = row.clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    for t in set(tokens):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    out = tokens[len(tokens) - n_out :] if n_out else []
    for word in p.bad_words:
        if not word[:-1] or out[len(out) - len(word) + 1 :] == list(word[:-1]):
            x[word[-1]] = float("-inf")
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def test_batched_penalties_equal_the_row_by_row_definition():
    logits = _logits(4, 2.0, seed=5)
    params = [
        SamplingParams(logit_bias=((7, 3.0), (7, 1.0), (11, -2.0))),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(),  # untouched
        SamplingParams(presence_penalty=-0.5, bad_words=((5, 9), (13,))),
    ]
    histories = [[1, 2, 3], [4, 4, 5, 9, 9, 9], [6], [2, 5, 5]]
    outputs = [1, 4, 0, 1]
    got = adjust_logits(logits, params, histories, outputs)
    for i, p in enumerate(params):
        want = _row_reference(logits[i], p, histories[i], outputs[i])
        assert torch.allclose(got[i], want), i
    assert adjust_logits(logits, [SamplingParams()] * 4, histories, outputs) is logits


def test_draws_follow_the_filtered_distribution():
    """6,000 draws per row; each token's frequency within 4.5 standard errors of its
    probability (temperature, top-k and min-p rows)."""
    base = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0, 0.0])
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    n = 6_000
    logits = base.expand(n * len(params), -1).contiguous()
    tokens, _ = sample(logits, [p for p in params for _ in range(n)], [0] * len(logits))
    for j, p in enumerate(params):
        x = _filter(base, p)
        probs = torch.softmax(_min_p(x, p.min_p) if p.min_p else x, -1)
        counts = torch.bincount(torch.tensor(tokens[j * n : (j + 1) * n]), minlength=6)
        for t in range(6):
            q = float(probs[t])
            if q == 0:
                assert counts[t] == 0, (p, t)
            else:
                assert abs(counts[t] / n - q) <= 4.5 * math.sqrt(q * (1 - q) / n), (p, t)


def test_a_seeded_row_draws_alike_alone_and_in_any_batch():
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=21)
    row = _logits(1, 1.0, seed=8)
    alone = [sample(row, [p], [k])[0][0] for k in range(12)]
    for k in range(12):
        others = _logits(3, 1.0, seed=50 + k)
        batch = torch.cat([others[:1], row, others[1:]])
        params = [SamplingParams(temperature=1.0), p, SamplingParams(), SamplingParams(top_k=5)]
        assert sample(batch, params, [3, k, 3, 3])[0][1] == alone[k]
        assert int(sample_batch(batch, params, [3, k, 3, 3])[1, 0]) == alone[k]
    assert len(set(alone)) > 3


def test_a_row_with_every_token_masked_still_samples_inside_the_vocabulary():
    """A guide that allows no token leaves a row of -inf (the gateway fuzz found one): the
    drawn rows must not index past the vocabulary (they crashed the step), as greedy's do not."""
    logits = torch.full((len(MIXED), VOCAB), float("-inf"))
    logits[1:, 5] = 0.0  # every row but the first... and the first drawn row has nothing
    logits[1, 5] = float("-inf")
    tokens, _ = sample(logits, MIXED, [0] * len(MIXED))
    assert all(0 <= t < VOCAB for t in tokens)
    assert tokens[2:] == [5] * (len(MIXED) - 2)  # the rows with one allowed token take it
