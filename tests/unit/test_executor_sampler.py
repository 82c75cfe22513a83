"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling import SamplingParams
from services.executor.sampler import sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])


def test_greedy_returns_argmax_and_its_logprob():
    tokens, logprobs = sample(LOGITS, [SamplingParams()], [0])
    assert tokens == [0]
    assert logprobs[0] == pytest.approx(torch.log_softmax(LOGITS[0], -1)[0].item())


def test_top_k_and_top_p_restrict_the_support():
    draws_k = {
        sample(LOGITS, [SamplingParams(temperature=5.0, top_k=2)], [0])[0][0] for _ in range(200)
    }
    assert draws_k == {0, 1}
    probs = torch.softmax(LOGITS[0], -1)  # 0.61, 0.22, 0.14, ...
    draws_p = {
        sample(LOGITS, [SamplingParams(temperature=1.0, top_p=0.7)], [0])[0][0] for _ in range(200)
    }
    assert draws_p == {0, 1} and probs[0] < 0.7 <= probs[0] + probs[1]


def test_temperature_sampling_follows_the_distribution():
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, _ = sample(LOGITS.expand(4000, -1), params, [0] * 4000)
    freq = tokens.count(0) / 4000
    assert freq == pytest.approx(torch.softmax(LOGITS[0], -1)[0].item(), abs=0.04)


def test_seed_and_output_index_make_draws_reproducible():
    p = SamplingParams(temperature=1.0, seed=42)
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [p], [i])[0][0] for i in range(20)]
    b = [sample(logits, [p], [i])[0][0] for i in range(20)]
    assert a == b and len(set(a)) > 10  # same per index, varied across indices


def test_logprob_is_under_the_raw_distribution():
    _, logprobs = sample(LOGITS, [SamplingParams(temperature=0.5, top_k=1)], [0])
    assert math.isclose(logprobs[0], torch.log_softmax(LOGITS[0], -1)[0].item(), rel_tol=1e-6)
