"""Engine on tiny random-weight models: parity with transformers, step validation, sampling."""

from __future__ import annotations

import copy

import pytest
import torch

from lab.executor.testing import teacher_forced_logits
from lab.executor.tiny import ARCHS, make_tiny_model
from services.common.step import NewRequestData, SchedulerOutput
from services.executor.engine import Engine

PROMPTS = [
    list(range(200, 290)),
    list(range(1000, 1013)),
    list(range(5000, 5070)),
    list(range(300, 302)),
]
CHUNKS = [1, 7, 64, None]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch, seed=1) for arch in ARCHS}


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_parity_mixed_chunks(tiny_dirs, arch, block_size):
    """The block size moves where chunks and prompts cross block boundaries (7-token chunks
    straddle blocks of every size) and how long each block table is."""
    from transformers import AutoModelForCausalLM

    engine = Engine(
        tiny_dirs[arch],
        dtype="fp32",
        num_device_blocks=32,
        num_host_blocks=4,
        block_size=block_size,
    )
    assert engine.describe()["block_size"] == block_size
    ours = teacher_forced_logits(engine, PROMPTS, CHUNKS)
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32)
    for ids, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max() < 1e-4


def _engine(tiny_dirs, **kw):
    return Engine(tiny_dirs["llama"], dtype="fp32", num_device_blocks=16, num_host_blocks=4, **kw)


def _admit(engine, rid="a", n=20, blocks=(0, 1)):
    return engine.step(
        SchedulerOutput(
            0,
            [NewRequestData(rid, list(range(100, 100 + n)))],
            {rid: (list(blocks), False)},
            {rid: n},
        )
    )


def _state(engine):
    return (
        copy.deepcopy({k: vars(v) for k, v in engine.requests.items()}),
        engine.owners.snapshot(),
    )


BAD_STEPS = {
    "unknown request": SchedulerOutput(1, num_scheduled_tokens={"nope": 1}),
    "block out of range": SchedulerOutput(1, block_tables={"a": ([99], False)}),
    "negative block": SchedulerOutput(1, block_tables={"a": ([-1], False)}),
    "block given twice": SchedulerOutput(
        1, [NewRequestData("b", [5, 6])], {"b": ([1], False)}, {"b": 2}
    ),
    "block twice in one table": SchedulerOutput(1, block_tables={"a": ([3, 3], False)}),
    "chunk past tokens": SchedulerOutput(1, num_scheduled_tokens={"a": 2}),
    "table too short": SchedulerOutput(
        1, [NewRequestData("b", list(range(40)))], {"b": ([2], False)}, {"b": 40}
    ),
    "duplicate new": SchedulerOutput(1, [NewRequestData("a", [1, 2])]),
    "empty prompt": SchedulerOutput(1, [NewRequestData("b", [])]),
    "token out of vocab": SchedulerOutput(1, [NewRequestData("b", [10**7])]),
    "swap out of range": SchedulerOutput(1, swap_out=[(0, 99)]),
    "swap into owned block": SchedulerOutput(1, swap_in=[(0, 1)]),
    "zero tokens": SchedulerOutput(1, num_scheduled_tokens={"a": 0}),
    # prefix sharing: only whole cached blocks below the cached tokens may be shared
    "cached tokens not whole blocks": SchedulerOutput(
        1, [NewRequestData("b", list(range(100, 120)), num_cached_tokens=5)], {"b": ([0, 5], False)}
    ),
    "cached tokens cover every token": SchedulerOutput(
        1, [NewRequestData("b", list(range(100, 116)), num_cached_tokens=16)], {"b": ([0], False)}
    ),
    "shared block past the cached tokens": SchedulerOutput(
        1,
        [NewRequestData("b", list(range(100, 140)), num_cached_tokens=16)],
        {"b": ([0, 1, 5], False)},
        {"b": 24},
    ),
    "swap out of a shared block": SchedulerOutput(1, swap_out=[(1, 0)]),
    "table for unknown": SchedulerOutput(1, block_tables={"zz": ([5], False)}),
}


@pytest.mark.parametrize("name", sorted(BAD_STEPS))
def test_malformed_step_rejected_without_change(tiny_dirs, name):
    engine = _engine(tiny_dirs)
    _admit(engine)
    before = _state(engine)
    kv_before = {k: t.clone() for k, t in engine.cache.tensors.items()}
    # the bad step also carries a valid decode and a new request that must not be applied
    bad = copy.deepcopy(BAD_STEPS[name])
    bad.new_requests.append(NewRequestData("c", [1, 2, 3]))
    bad.block_tables.setdefault("c", ([7], False))
    bad.num_scheduled_tokens.setdefault("c", 3)
    bad.num_scheduled_tokens.setdefault("a", 1)
    with pytest.raises(ValueError):
        engine.step(bad)
    assert _state(engine) == before
    assert all(torch.equal(kv_before[k], t) for k, t in engine.cache.tensors.items())
    out = engine.step(SchedulerOutput(2, num_scheduled_tokens={"a": 1}))  # still serves
    assert "a" in out.sampled


def test_swapped_request_needs_replacing_table(tiny_dirs):
    engine = _engine(tiny_dirs)
    _admit(engine)
    engine.step(SchedulerOutput(1, swap_out=[(0, 0), (1, 1)]))
    assert engine.requests["a"].block_table is None
    with pytest.raises(ValueError, match="swapped out"):
        engine.step(SchedulerOutput(2, num_scheduled_tokens={"a": 1}))
    # its old blocks are free for another request now
    _admit(engine, "b", 5, blocks=(0,))
    out = engine.step(
        SchedulerOutput(
            3,
            swap_in=[(0, 5), (1, 6)],
            block_tables={"a": ([5, 6], True)},
            num_scheduled_tokens={"a": 1},
        )
    )
    assert "a" in out.sampled


def test_free_is_idempotent_and_releases_blocks(tiny_dirs):
    engine = _engine(tiny_dirs)
    _admit(engine)
    engine.step(SchedulerOutput(1, free_request_ids=["a", "never-seen"]))
    assert engine.requests == {} and engine.owners.snapshot() == {}
    _admit(engine, "b", blocks=(0, 1))  # same blocks, no conflict
    assert engine.owners.snapshot() == {0: {"b"}, 1: {"b"}}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_cached_prefix_blocks_are_shared_read_only(tiny_dirs, kv_dtype):
    """A request attached to another's full block (num_cached_tokens) computes only the rest,
    with the logits of computing everything, and leaves the shared block untouched."""
    engine = _engine(tiny_dirs, kv_dtype=kv_dtype)
    _admit(engine, "a", 20, blocks=(0, 1))  # block 0 = tokens 100..115, full
    prompt = list(range(100, 116)) + [7, 8, 9, 10, 11]
    shared = engine.cache.tensors
    before = {k: t.clone() for k, t in shared.items()}
    out = engine.step(
        SchedulerOutput(
            1, [NewRequestData("b", prompt, num_cached_tokens=16)], {"b": ([0, 5], False)}, {"b": 5}
        ),
        all_logits=True,
    )
    assert out.num_prefill_tokens == 5 and out.logits["b"].shape[0] == 5
    assert engine.owners.snapshot()[0] == {"a", "b"}
    for k, t in shared.items():  # block 0 not written by b
        assert torch.equal(t[:, :, 0], before[k][:, :, 0])
    fresh = _engine(tiny_dirs, kv_dtype=kv_dtype)
    ref = fresh.step(
        SchedulerOutput(0, [NewRequestData("b", prompt)], {"b": ([3, 4], False)}, {"b": 21}),
        all_logits=True,
    )
    assert (out.logits["b"][-1] - ref.logits["b"][-1]).abs().max() < 1e-4
    assert out.sampled["b"][0] == ref.sampled["b"][0]
    # a and b go on decoding; freeing a keeps the block with b
    engine.step(SchedulerOutput(2, free_request_ids=["a"], num_scheduled_tokens={"b": 1}))
    assert engine.owners.snapshot()[0] == {"b"}


def test_counts_and_describe(tiny_dirs):
    engine = _engine(tiny_dirs, kv_dtype="int8")
    out = _admit(engine, n=20)
    assert out.num_prefill_tokens == 20 and out.num_decode_tokens == 0
    out = engine.step(SchedulerOutput(1, num_scheduled_tokens={"a": 1}))
    assert out.num_decode_tokens == 1 and out.timings.forward_s > 0
    info = engine.describe()
    assert info["architecture"] == "llama" and info["kv_dtype"] == "int8"
    assert info["num_device_blocks"] == 16 and info["bytes_per_block"] > 0
    assert len(info["instance_id"]) == 32


def test_llama3_rope_scaling_parity(tiny_dirs, tmp_path):
    """Llama 3's frequency-dependent RoPE scaling (`rope_type=llama3`): the same tiny weights
    with a scaled config match transformers, and the scaling really changes the logits (a
    runner that ignored it would fail). original_max_position_embeddings=64 puts most
    frequencies in the scaled band at these prompt lengths."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    scaled = tmp_path / "llama3"
    shutil.copytree(tiny_dirs["llama"], scaled)
    config = json.loads((scaled / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (scaled / "config.json").write_text(json.dumps(config))
    engine = Engine(scaled, dtype="fp32", num_device_blocks=32, num_host_blocks=4)
    ours = teacher_forced_logits(engine, PROMPTS, CHUNKS)
    model = AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    for ids, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
            unscaled = plain(torch.tensor([ids])).logits[0]
        assert (logits - ref).abs().max() < 1e-4
        if len(ids) > 16:
            assert (ref - unscaled).abs().max() > 1e-2


def _decode(engine, rid: str, step: int, n: int, eos: set[int]) -> list[int]:
    """Up to n decode steps of `rid` (its table already set), stopping after an EOS."""
    out = []
    for i in range(n):
        got = engine.step(SchedulerOutput(step + i, [], {}, {rid: 1})).sampled[rid][0]
        out.append(got)
        if got in eos:
            break
    return out


def test_guided_decoding_masks_every_row_and_survives_recompute(tiny_dirs):
    """A random-weight model under a regex guide: every sampled token keeps the text a prefix
    of the language, the answer ends (EOS) when the guide is complete, and a recompute that
    re-sends the output so far (num_output_tokens) continues from where it was."""
    import itertools
    import re

    from transformers import AutoTokenizer

    from services.common.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    pattern = "(cat|dog)( (cat|dog)){4}"
    guide = SamplingParams(temperature=1.0, seed=5, guide_kind="regex", guide_spec=pattern)
    engine = _engine(tiny_dirs)
    eos = set(engine.spec.eos_token_ids)
    prompt = list(range(100, 120))
    first = engine.step(
        SchedulerOutput(0, [NewRequestData("g", prompt, guide)], {"g": ([0, 1], False)}, {"g": 20})
    )
    output = [first.sampled["g"][0], *_decode(engine, "g", 1, 2, eos)]
    sentences = [" ".join(words) for words in itertools.product(("cat", "dog"), repeat=5)]
    assert any(s.startswith(tok.decode(output)) for s in sentences), tok.decode(output)
    # preempted by recompute: freed, then re-sent with its output so far
    engine.step(SchedulerOutput(3, [], {}, {}, free_request_ids=["g"]))
    again = NewRequestData("g", prompt + output, guide, num_output_tokens=len(output))
    resumed = engine.step(
        SchedulerOutput(4, [again], {"g": ([2, 3], False)}, {"g": len(prompt) + len(output)})
    )
    output += [resumed.sampled["g"][0], *_decode(engine, "g", 5, 16, eos)]
    assert output[-1] in eos
    assert re.fullmatch(pattern, tok.decode(output[:-1])), tok.decode(output)
    unguided = engine.step(
        SchedulerOutput(
            30,
            [NewRequestData("u", prompt, SamplingParams(temperature=1.0, seed=5))],
            {"u": ([4, 5], False)},
            {"u": 20},
        )
    ).sampled["u"][0]
    assert not re.fullmatch(r"(cat|dog)?", tok.decode([unguided]).strip())


def test_prompt_logprobs_match_transformers_across_chunks(tiny_dirs):
    """prompt_logprobs: every prompt position from 1 on gets the log-probability of its token
    given the tokens before it, with the top-k alternatives, equal to a full transformers
    forward pass, whatever chunks the prompt is computed in and whatever else the batch holds
    (a decode packed first). A request that does not ask gets nothing."""
    from transformers import AutoModelForCausalLM

    from services.common.sampling import SamplingParams

    engine = _engine(tiny_dirs)
    _admit(engine, "other", 20, blocks=(0, 1))
    prompt = list(range(3000, 3040))
    ask = SamplingParams(prompt_logprobs=3)
    got: dict[int, tuple] = {}
    step = SchedulerOutput(
        1, [NewRequestData("p", prompt, ask)], {"p": ([2, 3, 4], False)}, {"p": 7}
    )
    step.num_scheduled_tokens["other"] = 1
    for i, n in enumerate([7, 20, 13]):
        if i:
            step = SchedulerOutput(2 + i, num_scheduled_tokens={"p": n, "other": 1})
        out = engine.step(step)
        assert "other" not in out.prompt
        start, entries = out.prompt["p"]
        got.update({start + j: e for j, e in enumerate(entries)})
    assert sorted(got) == list(range(1, 40))  # the last chunk predicts up to position 39
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    for pos, (token, logprob, top) in got.items():
        assert token == prompt[pos]
        assert abs(logprob - ref[pos - 1, token].item()) < 1e-4
        values, ids = ref[pos - 1].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(top, values.tolist())) < 1e-4
