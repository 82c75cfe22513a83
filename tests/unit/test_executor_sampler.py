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


def test_raw_rows_draw_from_the_callers_probabilities_and_filtered_rows_do_not():
    """With `probs` (the probe's exp of the log_softmax), a temperature-1 unfiltered row draws
    from it: seeded draws are those of the sampler's own softmax; a filtered or hotter row
    ignores it (here a planted wrong `probs` would show)."""
    logits = torch.randn(3, 400, generator=torch.Generator().manual_seed(3))
    logp = torch.log_softmax(logits, -1)
    raw = [SamplingParams(temperature=1.0, seed=7)] * 3
    own = [sample(logits, raw, [i] * 3)[0] for i in range(30)]
    shared = [sample(logits, raw, [i] * 3, None, logp, logp.exp())[0] for i in range(30)]
    assert own == shared
    planted = torch.zeros_like(logits)
    planted[:, 5] = 1.0  # "always token 5"
    assert sample(logits, raw, [0] * 3, None, logp, planted)[0] == [5, 5, 5]
    hot = [SamplingParams(temperature=1.5, seed=7), SamplingParams(top_k=3, seed=7),
           SamplingParams(presence_penalty=0.5, seed=7)]  # fmt: skip
    for i in range(20):
        assert (
            sample(logits, hot, [i] * 3, [[1]] * 3, logp, planted)[0]
            == sample(logits, hot, [i] * 3, [[1]] * 3)[0]
        )


def test_logprob_is_under_the_raw_distribution():
    _, logprobs = sample(LOGITS, [SamplingParams(temperature=0.5, top_k=1)], [0])
    assert math.isclose(logprobs[0], torch.log_softmax(LOGITS[0], -1)[0].item(), rel_tol=1e-6)


def test_logit_bias_and_penalties_change_greedy_choices():
    # a bias of +5 on token 3 makes it the argmax; -100 on token 0 removes the old winner
    tokens, _ = sample(LOGITS, [SamplingParams(logit_bias=((3, 5.0),))], [0], [[1]])
    assert tokens == [3]
    tokens, _ = sample(LOGITS, [SamplingParams(logit_bias=((0, -100.0),))], [0], [[1]])
    assert tokens == [1]
    # token 0 was output twice: a frequency penalty of 1 takes 2 off its logit (2 -> 0)
    history = [4, 0, 0]  # prompt [4], outputs [0, 0]
    freq = SamplingParams(frequency_penalty=1.0)
    assert sample(LOGITS, [freq], [2], [history])[0] == [1]
    # presence counts once: 2 - 0.8 = 1.2 still beats 1.0
    assert sample(LOGITS, [SamplingParams(presence_penalty=0.8)], [2], [history])[0] == [0]
    # repetition divides positive logits of every seen token, prompt included
    rep, logits = SamplingParams(repetition_penalty=2.0), torch.tensor([[1.5, 1.0, -1.0]])
    assert sample(logits, [rep], [0], [[0]])[0] == [1]  # 1.5 / 2 = 0.75 < 1.0
    assert sample(logits, [rep], [0], [[0, 1]])[0] == [0]  # both halved: 0.75 vs 0.5
    from services.executor.sampler import _adjust

    assert _adjust(-logits[0], rep, [1, 2], 0).tolist() == [-1.5, -2.0, 0.5]  # neg. multiplied

    # penalties only count output tokens: the same token in the prompt is not penalized
    assert sample(LOGITS, [freq], [0], [[0, 0]])[0] == [0]


def test_min_p_drops_unlikely_tokens_from_sampling():
    p = SamplingParams(temperature=1.0, min_p=0.3, seed=1)
    probs = torch.softmax(LOGITS[0], -1)
    allowed = {i for i in range(5) if probs[i] >= 0.3 * probs.max()}
    drawn = {
        sample(LOGITS, [SamplingParams(temperature=1.0, min_p=0.3, seed=s)], [0], [[]])[0][0]
        for s in range(200)
    }
    assert drawn == allowed and len(allowed) < 5 and p.adjusts_logits


def test_new_fields_round_trip_through_proto_and_json():
    from services.common import sampling_pb

    p = SamplingParams(
        temperature=0.5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.5,
        min_p=0.125,
        logit_bias=((7, 2.5), (3, -1.0)),
    )
    assert sampling_pb.from_pb(sampling_pb.to_pb(p)) == p  # (values exact in float32)
    assert (
        SamplingParams.from_dict(__import__("json").loads(__import__("json").dumps(p.to_dict())))
        == p
    )
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 200.0),))
    assert SamplingParams(repetition_penalty=0).repetition_penalty == 1.0  # proto unset


def test_top_alternatives_only_for_rows_that_ask():
    from services.executor.sampler import top_alternatives

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    got = top_alternatives(logits, [SamplingParams(top_logprobs=2), SamplingParams()])
    assert got[1] == []
    ids, values = zip(*got[0])
    assert ids == (0, 1)
    expected = torch.log_softmax(logits[0], -1)
    assert values == pytest.approx([expected[0].item(), expected[1].item()])
    both = top_alternatives(
        logits, [SamplingParams(top_logprobs=1), SamplingParams(top_logprobs=4)]
    )
    assert [t for t, _ in both[0]] == [0] and [t for t, _ in both[1]] == [1, 3, 2, 0]
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)


def test_bad_words_ban_the_completing_token_only_after_the_rest():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    one = SamplingParams(bad_words=((1,),))  # token 1 alone: never
    assert sample(logits, [one], [0], [[3]])[0] == [2]
    two = SamplingParams(bad_words=((3, 1),))  # 1 only right after 3
    assert sample(logits, [two], [1], [[0, 3]])[0] == [2]  # output so far ends with 3
    assert sample(logits, [two], [1], [[3, 0]])[0] == [1]  # it does not
    assert sample(logits, [two], [0], [[3]])[0] == [1]  # the 3 is the prompt's, not output
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=((),))
