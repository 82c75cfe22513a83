"""Compare the Triton backend with the torch reference on one small mixed step.

    TRITON_INTERPRET=1 python -m services.executor.triton_check     # CPU, interpreter
Prints {kv_dtype: {"out": max |diff| of attention outputs, "cache": max |diff| of the KV
pool after the write}}. Shapes are tiny: the interpreter runs every program in Python.
"""

from __future__ import annotations

import json

import torch

from services.executor.attention import TorchAttention
from services.executor.int8_kv import Int8PagedKV
from services.executor.kv_cache import PagedKV
from services.executor.ragged_batch import TokenRun, build_batch

HKV, G, D, BS, LAYERS, BLOCKS = 2, 2, 16, 4, 1, 24


def _step(cache, backend, q, k, v, runs):
    batch = build_batch(runs, BS, q.device)
    cache.prepare(batch)
    backend.prepare(batch)
    return backend.forward(0, q, k, v, cache, batch)


def _caches(cls, device, gen):
    caches = [cls(LAYERS, BLOCKS, BS, HKV, D, torch.float32, device) for _ in range(2)]
    for name, t in caches[0].tensors.items():  # same random history in both pools
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen))
        else:
            t.copy_(torch.rand(t.shape, generator=gen) * 0.05 + 0.01)
        caches[1].tensors[name].copy_(t)
    return caches


def compare(device: str = "cpu", seed: int = 0) -> dict:
    from services.executor.triton_attention import TritonAttention

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    results = {}
    for kv, cls in (("auto", PagedKV), ("int8", Int8PagedKV)):
        caches = _caches(cls, dev, gen)
        opened = [[c.open_request(r) for r in "abc"] for c in caches]  # same slots in both
        slots = opened[0]
        # step 1: a 9-token prompt (2 full blocks + 1 open), a 6-token prompt, 3-token prompt
        # step 2: decode of a, a 5-token chunk of b (crosses a block), whole of a new 3-token c
        plans = [
            [("a", 9, 0, [3, 7, 1]), ("b", 6, 0, [0, 5, 9]), ("c", 3, 0, [11])],
            [("a", 1, 9, [3, 7, 1]), ("b", 5, 6, [0, 5, 9]), ("c", 1, 3, [11])],
        ]
        outs = []
        for plan in plans:
            runs = [
                TokenRun(r, [0] * n, before, blocks, slots["abc".index(r)], True)
                for r, n, before, blocks in plan
            ]
            t = sum(n for _, n, _, _ in plan)
            q = torch.randn(t, HKV * G, D, generator=gen).to(dev)
            k = torch.randn(t, HKV, D, generator=gen).to(dev)
            v = torch.randn(t, HKV, D, generator=gen).to(dev)
            ref = _step(caches[0], TorchAttention(HKV * G, HKV, D, D**-0.5), q, k, v, runs)
            tri = _step(caches[1], TritonAttention(HKV * G, HKV, D, D**-0.5, dev), q, k, v, runs)
            outs.append((ref - tri).abs().max().item())
        cache_diff = max(
            (caches[0].tensors[n].float() - caches[1].tensors[n].float()).abs().max().item()
            for n in caches[0].tensors
        )
        results[kv] = {"out": max(outs), "cache": cache_diff}
    return results


if __name__ == "__main__":
    print(json.dumps(compare()))
