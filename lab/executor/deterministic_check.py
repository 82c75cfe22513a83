"""Deterministic mode's CUDA path (batch_invariant.py) checked where it runs: under Triton's
interpreter on CPU (`TRITON_INTERPRET=1`), natively on a GPU.

    python -m lab.executor.deterministic_check [--device cuda] [--engine MODEL_DIR]

Prints one JSON object: `matmul` (triton_matmul.linear: the largest change of a row between
its product alone and in batches of other sizes and places, 0.0 when batch-invariant, and the
error against F.linear), and with --engine `engine` (a tiny Llama on the Triton backend with the
fused layer and the deterministic products and attention: the largest difference of a prompt's
teacher-forced logits alone, one token a step and in mixed batches at other chunk sizes).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

PROMPT = list(range(300, 320))
OTHERS = [list(range(1000, 1031)), list(range(40, 49)), list(range(7000, 7017))]


def matmul_invariance(device: str = "cpu") -> dict[str, float]:
    from services.executor import triton_matmul

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 96, generator=gen) * 0.1).to(device)
    bias = torch.randn(200, generator=gen).to(device)
    x = torch.randn(150, 96, generator=gen).to(device)
    full = triton_matmul.linear(x, w, bias)
    worst = 0.0
    for m in (1, 2, 17, 64, 65, 150):
        worst = max(worst, float((triton_matmul.linear(x[:m], w, bias) - full[:m]).abs().max()))
        moved = triton_matmul.linear(torch.cat([x[1:m], x[:1]]), w, bias)[m - 1]
        worst = max(worst, float((moved - full[0]).abs().max()))
    err = float((full - F.linear(x, w, bias)).abs().max())
    return {"max_row_change": worst, "error_vs_torch": err}


def engine_invariance(model_dir: str, device: str = "cpu") -> float:
    """Max |diff| of PROMPT's logits between alone, one token a step and two mixed batches,
    on the CUDA deterministic configuration (on CPU: interpreted, fp32, and the LM head on
    the CPU's tiled product, because the vocabulary-wide Triton product takes 30 s a call
    interpreted)."""
    from lab.executor.testing import teacher_forced_logits
    from services.executor import batch_invariant
    from services.executor.cuda_runtime import RuntimeOptions
    from services.executor.engine import Engine

    options = RuntimeOptions(step_runtime="packed", graph_max_batch=8)
    engine = Engine(
        model_dir, device=device, dtype="fp32", block_size=8, num_device_blocks=96,
        num_host_blocks=2, attention_backend="triton", runtime=options,
    )  # fmt: skip
    engine.runner.fused = True  # type: ignore[union-attr]  (set on CUDA by the runner)
    batch_invariant.make_deterministic(engine.runner, engine.attn, cuda=True)
    if device == "cpu":
        engine.runner.head.product = batch_invariant.tiled_linear
    alone = teacher_forced_logits(engine, [PROMPT], [None])[0]
    others = [
        teacher_forced_logits(engine, [PROMPT], [1])[0],
        teacher_forced_logits(engine, [OTHERS[0], PROMPT, OTHERS[1]], [5, 7, None])[1],
        teacher_forced_logits(engine, [PROMPT, *OTHERS], [3, 1, 64, 2])[0],
    ]
    return max(float((alone - o).abs().max()) for o in others)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", metavar="MODEL_DIR", help="also a whole tiny engine")
    args = parser.parse_args(argv)
    out: dict[str, object] = {"matmul": matmul_invariance(args.device)}
    if args.engine:
        out["engine"] = engine_invariance(args.engine, args.device)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
