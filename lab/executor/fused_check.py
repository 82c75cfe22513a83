"""The fused Triton kernels (services/executor/triton_fused.py) against the unfused torch path.

    TRITON_INTERPRET=1 python -m lab.executor.fused_check [--engine TINY_DIR]   # CPU
    python -m lab.executor.fused_check --device cuda

Prints {"add_rms_norm": {dtype: max error}, "silu_and_mul": ..., "rope_qkv": ..., "engine":
{dtype: max |logits diff| fused on vs off}} on random rows (llama.rms_norm, F.silu(gate) * up,
llama.apply_rope as the references); tests/unit/test_triton_fused.py bounds them.
"""

from __future__ import annotations

import argparse
import json

import torch

from services.executor.triton_fused import add_rms_norm, rope_qkv, rope_table, silu_and_mul


def compare(device: str = "cpu", seed: int = 0) -> dict[str, dict[str, float]]:
    """Max |fused - unfused| of both kernels on random rows (hidden 576 and 64, with and
    without the residual add; inner 1536 and 100), per dtype, and the worst in bf16 ulps."""
    from services.executor.llama import rms_norm

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, float]] = {"add_rms_norm": {}, "silu_and_mul": {}, "rope_qkv": {}}
    dtypes = (torch.float32, torch.bfloat16) + ((torch.float16,) if device == "cuda" else ())
    for dtype in dtypes:
        name = str(dtype).split(".")[-1]
        errs = []
        for t, n in ((5, 576), (3, 64)):
            x, d = (torch.randn(t, n, generator=gen).to(device, dtype) for _ in "xd")
            w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, dtype)
            ref_x = x + d
            ref_h = rms_norm(ref_x, w, 1e-5)
            new_x, new_h = add_rms_norm(x.clone(), d, w, 1e-5)
            _, only_h = add_rms_norm(ref_x.clone(), None, w, 1e-5)
            errs += [(new_x - ref_x).abs().max(), _rel(new_h, ref_h), _rel(only_h, ref_h)]
        out["add_rms_norm"][name] = max(e.item() for e in errs)
        errs = []
        for t, i in ((4, 1536), (2, 100)):
            gu = (2 * torch.randn(t, 2 * i, generator=gen)).to(device, dtype)
            gate, up = gu.chunk(2, dim=-1)
            errs.append(_rel(silu_and_mul(gu), torch.nn.functional.silu(gate) * up))
        out["silu_and_mul"][name] = max(e.item() for e in errs)
        out["rope_qkv"][name] = _rope_error(device, dtype, gen)
    return out


def _rope_error(device: str, dtype: torch.dtype, gen: torch.Generator) -> float:
    """Max |fused - unfused| of q, k, v: 4 query and 2 KV heads of 32, positions to 4,000."""
    from services.executor.llama import apply_rope

    h, hkv, d, t = 4, 2, 32, 7
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    pos = torch.randint(0, 4000, (t,), generator=gen).to(device)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(device, dtype)
    freqs = pos[:, None].float().cpu() * inv_freq[None, :]
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[:, None, :].to(device)
    sin = freqs.sin()
    sin_signed = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :].to(device)
    qk = apply_rope(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), cos, sin_signed)
    refs = (qk[:, :h], qk[:, h:], qkv[:, (h + hkv) * d :].view(t, hkv, d))
    table = rope_table(inv_freq, 1.0, 4000, dtype, torch.device(device))
    fused = rope_qkv(qkv, pos.to(torch.int32), table, h, hkv, d)
    return max(
        (a.double() - b.double()).abs().max().item() for a, b in zip(fused, refs, strict=True)
    )


def engine_diff(model_dir: str, dtype: str) -> float:
    """Max |logits| difference of one Engine (Triton attention) with the fused kernels on and
    off: prompts of 1..23 tokens, fed in chunks of 5 (prefill chunks and decodes mixed)."""
    from lab.executor.testing import teacher_forced_logits
    from services.executor.engine import Engine

    engine = Engine(model_dir, device="cpu", dtype=dtype, attention_backend="triton",
                    num_device_blocks=64, num_host_blocks=1)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (1, 9, 23)]
    runs = []
    for fused in (False, True):
        engine.runner.fused = fused
        runs.append(teacher_forced_logits(engine, prompts, [5, 5, 5]))
    return max((a - b).abs().max().item() for a, b in zip(*runs, strict=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """max |a - b| / max(|b|, tiny): elementwise relative error (rounding flips: one ulp)."""
    a, b = a.double(), b.double()
    return ((a - b).abs() / b.abs().clamp_min(1e-6)).max()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", metavar="MODEL_DIR", help="also whole engines, fused vs not")
    args = parser.parse_args(argv)
    result: dict = compare(args.device)
    if args.engine:
        result["engine"] = {d: engine_diff(args.engine, d) for d in ("fp32", "bf16")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
