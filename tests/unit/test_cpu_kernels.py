"""The compiled CPU decode kernel (cpu_kernels.py, csrc/paged_decode.cpp): attention read
straight from the paged pool against plain attention over each request's own keys, and whole
engines on the kernel against engines on the torch path, full precision and INT8 KV, on every
ISA level this CPU runs (x86-64-v3, x86-64-v4, native); the levels return the same numbers."""

from __future__ import annotations

import math

import pytest
import torch

from lab.executor.tiny import make_tiny_model
from services.executor import cpu_kernels
from services.executor.attention_backends import make_attention
from services.executor.config import ModelSpec

# Built here (a C++ compiler and ninja come with `make setup`): a failed build must fail the
# suite, not skip it. ALISE_CPU_KERNELS=off is the only way out.
if cpu_kernels.disabled():
    pytest.skip("compiled CPU kernels turned off (ALISE_CPU_KERNELS)", allow_module_level=True)

BS = 16
LEVELS = cpu_kernels.runnable_levels()
LENS = [1, 16, 17, 100, 512, 3, 64]  # one key, exactly one block, a block and one, ...


def _reference(q, k_pool, v_pool, tables, lens, scale):
    """Attention of q [B, H, D] over each request's first lens[b] keys, fp32."""
    b_count, h, d = q.shape
    hkv, bs = k_pool.shape[0], k_pool.shape[2]
    out = torch.empty(b_count, h, d)
    for b in range(b_count):
        n, nb = int(lens[b]), math.ceil(int(lens[b]) / bs)
        k = k_pool[:, tables[b, :nb]].reshape(hkv, -1, d)[:, :n].float()
        v = v_pool[:, tables[b, :nb]].reshape(hkv, -1, d)[:, :n].float()
        qh = q[b].view(hkv, h // hkv, d).float()
        p = torch.softmax(qh @ k.transpose(1, 2) * scale, dim=-1)
        out[b] = (p @ v).reshape(h, d)
    return out


def _case(hkv, groups, d, bs, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nb_max = max(math.ceil(n / bs) for n in LENS)
    num_blocks = len(LENS) * nb_max + 5
    pools = [torch.randn(hkv, num_blocks, bs, d, generator=gen).to(dtype) for _ in range(2)]
    # scattered blocks, some runs consecutive (the prefetch takes both branches)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(LENS) * nb_max].view(len(LENS), nb_max).clone()
    tables[0] = torch.arange(nb_max)
    q = torch.randn(len(LENS), hkv * groups, d, generator=gen).to(dtype)
    return q, pools[0], pools[1], tables, torch.tensor(LENS)


@pytest.fixture(params=LEVELS)
def level(request):
    """One build of the kernels in use for the test; the default one put back after."""
    before = cpu_kernels.active_level() if cpu_kernels.load() else None
    assert cpu_kernels.use(request.param), f"the {request.param} build failed"
    yield request.param
    if before is not None:
        cpu_kernels.use(before)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hkv,groups", [(1, 1), (2, 3), (1, 7), (2, 8)])
def test_kernel_matches_attention_over_each_requests_keys(level, d, hkv, groups):
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for bs in (16, 32):
            q, k, v, tables, lens = _case(hkv, groups, d, bs, dtype)
            out = cpu_kernels.paged_decode(q, k, v, tables, lens, d**-0.5)
            assert out.dtype == dtype and out.shape == q.shape
            err = (out.float() - _reference(q, k, v, tables, lens, d**-0.5)).abs().max()
            assert err <= tol, (dtype, bs, float(err))


def test_kernel_refuses_what_it_was_not_built_for():
    assert cpu_kernels.load()
    q, k, v, tables, lens = _case(1, 2, 64, BS, torch.float32)
    with pytest.raises(RuntimeError, match="head dim 32"):
        cpu_kernels.paged_decode(
            q[..., :32].contiguous(),
            k[..., :32].contiguous(),
            v[..., :32].contiguous(),
            tables,
            lens,
            1.0,
        )
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.paged_decode(q.bfloat16(), k, v, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernels.paged_decode(q, k, v, tables.int(), lens, 1.0)


def test_auto_backend_takes_the_kernel_for_its_head_sizes_only():
    spec = dict(
        arch="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=100,
        max_model_len=64,
    )
    cpu = torch.device("cpu")
    assert make_attention(ModelSpec(**spec, head_dim=64), "auto", cpu).name == "cpu"
    assert make_attention(ModelSpec(**spec, head_dim=16), "auto", cpu).name == "torch"
    with pytest.raises(ValueError, match="head dim"):
        make_attention(ModelSpec(**spec, head_dim=16), "cpu", cpu)


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    return {
        (arch, d): make_tiny_model(root / f"{arch}{d}", arch, seed=3, head_dim=d)
        for arch, d in (("llama", 64), ("qwen2", 128))
    }


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_engine_on_the_kernel_matches_the_torch_path(level, wide_models, kv_dtype):
    """Teacher-forced logits over mixed steps (prompts whole and chunked, then decodes) are
    the same on both backends; INT8 KV reads the same codes, scales and staging blocks."""
    from lab.executor.testing import teacher_forced_logits
    from services.executor.engine import Engine

    prompts = [list(range(5, 5 + n)) for n in (37, 9, 70, 16)]
    chunks = [8, None, 32, 1]
    for model in wide_models.values():
        logits = []
        for backend in ("torch", "cpu"):
            engine = Engine(
                model,
                device="cpu",
                dtype="fp32",
                kv_dtype=kv_dtype,
                block_size=8,
                num_device_blocks=48,
                num_host_blocks=2,
                attention_backend=backend,
            )
            assert engine.describe()["attention_backend"] == backend
            logits.append(teacher_forced_logits(engine, prompts, chunks))
            engine.close()
        err = max(float((a - b).abs().max()) for a, b in zip(*logits, strict=True))
        assert err < 1e-4, (model.name, kv_dtype, err)


@pytest.mark.parametrize("rows", [1, 32, 200])  # one row alone, a decode batch, threaded
def test_silu_and_mul_matches_torch(rows):
    assert cpu_kernels.load()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 1536, generator=gen) * 4
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert torch.allclose(cpu_kernels.silu_and_mul(x), want, rtol=1e-5, atol=1e-5)
    got = cpu_kernels.silu_and_mul(x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    # a view that is not contiguous takes torch's path, same numbers
    wide = torch.cat([x, x], dim=1)[:, : 2 * 1536]
    assert torch.allclose(cpu_kernels.silu_and_mul(wide), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 32, 300])  # one row alone, a decode batch, threaded
def test_rms_norm_matches_transformers_rounding(rows):
    """fp32 within float rounding of torch's; bf16 normalized in fp32, rounded, scaled and
    rounded again as transformers' LlamaRMSNorm: the same bits but for the rare value whose
    sum of squares rounds the other way (then a step off, two after the weight); a 3-D view (QK-norm heads)."""
    assert cpu_kernels.load()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * 3
    w = torch.randn(576, generator=gen)
    want = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    assert torch.allclose(cpu_kernels.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    want_b = wb * torch.nn.functional.rms_norm(xb.float(), (576,), eps=1e-5).bfloat16()
    heads = xb.view(rows, 9, 64)
    want_h = wb[:64] * torch.nn.functional.rms_norm(heads.float(), (64,), eps=1e-5).bfloat16()
    got_h = cpu_kernels.rms_norm(heads, wb[:64].contiguous(), 1e-5)
    for got, want_ in ((cpu_kernels.rms_norm(xb, wb, 1e-5), want_b), (got_h, want_h)):
        assert got.shape == want_.shape and got.dtype == torch.bfloat16
        assert float((got != want_).float().mean()) < 1e-3
        assert torch.allclose(got.float(), want_.float(), rtol=2**-6, atol=0)  # 2 steps
    assert cpu_kernels.rms_norm(xb, w, 1e-5) is None  # mixed dtypes: the caller's torch path


def test_decode_step_benchmark_runs_both_backends_side_by_side():
    """`alise bench decode-step` on the bundled model, a tiny step: one row per backend, each
    with a step and a linear-only time (the figures in docs/executor.md come from it)."""
    import argparse

    from bench.bench_decode_step import measure

    args = argparse.Namespace(
        threads=0,
        dtypes="fp32",
        kv_dtypes="auto,int8",
        attention="torch,cpu",
        rounds=1,
        batch=2,
        context=40,
        kv_memory_gb=0.05,
        isa=LEVELS[0],
    )
    before = cpu_kernels.active_level() if cpu_kernels.load() else None
    out = measure(args)
    if before:
        cpu_kernels.use(before)
    got = {(r["kv_dtype"], r["attention"], r["isa"]) for r in out["rows"]}
    want = {(kv, "torch", None) for kv in ("auto", "int8")}
    assert got == want | {(kv, "cpu", LEVELS[0]) for kv in ("auto", "int8")}
    for r in out["rows"]:
        assert r["step_ms"] > 0 and r["linear_only_ms"] > 0
        assert r["step_over_linear"] == pytest.approx(r["step_ms"] / r["linear_only_ms"])


def _int8_case(seed=0):
    """A request mix over an INT8 pool (codes, fp16 scales/offsets) and bf16 staging blocks."""
    gen = torch.Generator().manual_seed(seed)
    hkv, groups, d, bs, nb = 2, 3, 64, BS, 64
    lens = torch.tensor([5, 16, 40, 100])
    pools = {
        "kq": torch.randint(0, 256, (hkv, nb, bs, d), dtype=torch.uint8, generator=gen),
        "vq": torch.randint(0, 256, (hkv, nb, bs, d), dtype=torch.uint8, generator=gen),
        "ks": (torch.rand(hkv, nb, d, generator=gen) / 50).half(),
        "ko": torch.randn(hkv, nb, d, generator=gen).half(),
        "vs": (torch.rand(hkv, nb, bs, generator=gen) / 50).half(),
        "vo": torch.randn(hkv, nb, bs, generator=gen).half(),
    }
    stage = [torch.randn(hkv, len(lens), bs, d, generator=gen).bfloat16() for _ in range(2)]
    tables = torch.randperm(nb, generator=gen)[: len(lens) * 8].view(len(lens), 8).clone()
    q = torch.randn(len(lens), hkv * groups, d, generator=gen).bfloat16()
    return q, pools, stage, tables, torch.arange(len(lens)), lens


def test_every_isa_level_computes_the_same_numbers():
    """Builds for x86-64-v3 and x86-64-v4 return the same bits (no -ffast-math, fixed
    reduction order, one exp: csrc/vec.h); `native` the same within fp32 rounding."""
    builds = {lvl: cpu_kernels.load_level(lvl) for lvl in LEVELS}
    assert all(builds.values()), builds
    q, k, v, tables, lens = _case(2, 4, 128, BS, torch.float32, seed=5)
    x = torch.randn(64, 2 * 1536, generator=torch.Generator().manual_seed(5)) * 4
    iq, p, (ks, vs), itables, slots, ilens = _int8_case()
    int8_args = (iq, p["kq"], p["ks"], p["ko"], p["vq"], p["vs"], p["vo"], ks, vs, itables)
    outs = {
        lvl: [
            b.ops.paged_decode(q, k, v, tables, lens, 0.125),
            b.ops.paged_decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, lens, 0.125),
            b.ops.silu_and_mul(x),
            b.ops.silu_and_mul(x.bfloat16()),
            b.ops.rms_norm(x, x[0].contiguous(), 1e-5),
            b.ops.rms_norm(x.bfloat16(), x[0].bfloat16().contiguous(), 1e-5),
            b.ops.paged_decode_int8(*int8_args, slots, ilens, 0.125),
        ]
        for lvl, b in builds.items()
        if b is not None
    }
    first = outs[LEVELS[0]]
    for lvl, out in outs.items():
        for a, b in zip(first, out, strict=True):
            if lvl == "native":
                assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), lvl
            else:
                assert torch.equal(a, b), lvl


def test_int8_kernel_matches_dequantized_attention():
    """The INT8 kernel (scales folded into the query, offsets as separate sums) against plain
    attention over the dequantized codes followed by the staging rows."""
    assert cpu_kernels.load()
    q, pools, (ks, vs), tables, slots, lens = _int8_case(1)
    out = cpu_kernels.paged_decode_int8(q, pools, ks, vs, tables, slots, lens, 0.125)
    hkv, d, bs = ks.shape[0], q.shape[2], BS
    for b, n in enumerate(lens.tolist()):
        full, tail = n // bs, n % bs
        blocks = tables[b, :full]
        k = pools["kq"][:, blocks].float() * pools["ks"][:, blocks, None].float()
        k = (k - pools["ko"][:, blocks, None].float()).reshape(hkv, -1, d)
        v = pools["vq"][:, blocks].float() * pools["vs"][:, blocks, :, None].float()
        v = (v - pools["vo"][:, blocks, :, None].float()).reshape(hkv, -1, d)
        k = torch.cat([k, ks[:, b, :tail].float()], dim=1)
        v = torch.cat([v, vs[:, b, :tail].float()], dim=1)
        qh = q[b].view(hkv, -1, d).float()
        want = (torch.softmax(qh @ k.transpose(1, 2) * 0.125, -1) @ v).reshape(-1, d)
        assert (out[b].float() - want).abs().max() <= 2e-2, b


def test_isa_levels_follow_the_cpu_flags(monkeypatch):
    v3 = set(cpu_kernels.V3_FLAGS)
    v4 = set(cpu_kernels.V4_FLAGS)
    assert cpu_kernels.runnable_levels({"sse2"}) == ["native"]
    assert cpu_kernels.runnable_levels(v3) == ["x86-64-v3", "native"]
    assert cpu_kernels.runnable_levels(v4 | {"amx_tile"}) == ["x86-64-v3", "x86-64-v4", "native"]
    monkeypatch.delenv("ALISE_CPU_ISA", raising=False)
    assert cpu_kernels.requested_level(v4 | {"avx512_fp16"}) == "x86-64-v4"  # never native
    assert cpu_kernels.requested_level(v3) == "x86-64-v3"
    assert cpu_kernels.requested_level({"sse2"}) is None
    monkeypatch.setenv("ALISE_CPU_ISA", "native")
    assert cpu_kernels.requested_level(v3) == "native"
    monkeypatch.setenv("ALISE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="ALISE_CPU_ISA"):
        cpu_kernels.requested_level(v3)


def test_build_name_follows_the_level_and_the_sources():
    names = {cpu_kernels.build_name(lvl) for lvl in cpu_kernels.LEVELS}
    assert len(names) == 3 and all(n.startswith("alise_cpu_") for n in names)


def test_a_build_lock_left_by_a_killed_loader_does_not_block_the_next():
    """torch's builder leaves its `lock` file behind when the process holding it is killed
    (an executor SIGKILLed while it starts); the next executor's load must not wait for it
    forever: it takes its own flock, finds the file stale and removes it."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from torch.utils import cpp_extension

    level = cpu_kernels.requested_level()
    if level is None:
        pytest.skip("no x86-64-v3 CPU: no kernels to load")
    assert cpu_kernels.load_level(level) is not None  # built (or already cached)
    name = cpu_kernels.build_name(level)
    baton = Path(cpp_extension._get_build_directory(name, False)) / "lock"
    baton.touch()  # what a loader killed while holding the baton leaves, a while ago
    old = time.time() - cpu_kernels.STALE_BATON_S - 1
    os.utime(baton, (old, old))
    code = f"from services.executor import cpu_kernels as k; print(k.load_level({level!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert f"Build(level='{level}'" in done.stdout, done.stderr[-2000:]
    assert not baton.exists()
