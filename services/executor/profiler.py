"""Self-profiler: time a grid of batches on this engine and fit the cost model
(docs/scheduling.md, "Cost model").

    iteration_time = c0 + c_prefill*P + c_decode*D + c_context*C

P = prefill tokens, D = decode tokens, C = attention context (sum over scheduled requests of
computed + new tokens). Coefficients are fitted by non-negative least squares. ALISE's model
is fitted on its own samples: T_pre(s) = s*T0 on lone prefills, T_dec(s, n) = n*(alpha*s + beta)
on decode-only batches. AccelGen's pivot forward size S_pf is the smallest prefill forward size
whose throughput reaches 90% of the best measured; T_pf is its iteration time.

Decode contexts are not computed: the profiler declares them computed over blocks of
arbitrary (finite) KV, which costs the same to attend over. It must run on an idle engine.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from scipy.optimize import nnls

from services.common.arith import ceil_div
from services.common.step import NewRequestData, SchedulerOutput
from services.scheduler.core.cost_model import Experts

if TYPE_CHECKING:
    from services.executor.engine_protocol import SteppingEngine

# decode counts 2 and 3 are measured on purpose: on CPU they cost far more than a line through
# 1 and 4 suggests (small-row matrix products), and the simulator's measured clock
# (core/residual.py) can only correct the shapes the profile holds
FULL = {
    "prefill": (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048),
    "decode": (1, 2, 3, 4, 8, 16, 32, 64),
    "context": (128, 512, 1024),
    "mixed": ((64, 8, 512), (256, 8, 512), (256, 32, 512), (512, 32, 256)),
    "reps": 3,
}
QUICK = {
    "prefill": (16, 64, 128, 256),
    "decode": (1, 8),
    "context": (64, 256),
    "mixed": ((64, 8, 128),),
    "reps": 2,
}
SATURATION = 0.9


class StepTimer:
    """Builds and times batches on an idle engine, reusing blocks from a private free list
    (the profiler's grid, and the engine benchmark's single steps)."""

    def __init__(self, engine: SteppingEngine, seed: int = 0) -> None:
        self.engine, self.bs, self.seed = engine, engine.block_size, seed
        # popped in ascending order and returned reversed, as the scheduler's BlockManager
        # hands blocks out: a request's blocks are consecutive, as in a fresh live pool
        self.free = list(range(engine.num_device_blocks - 1, -1, -1))
        self.n = 0
        self._computed: dict[str, tuple[int, list[int]]] = {}

    def _new(self, step: SchedulerOutput, length: int, computed: int) -> str:
        rid = f"profile-{self.n}"
        self.n += 1
        blocks = [self.free.pop() for _ in range(ceil_div(length + 8, self.bs))]
        step.new_requests.append(NewRequestData(rid, self._tokens(length)))
        step.block_tables[rid] = (blocks, False)
        self._computed[rid] = (computed, blocks)
        return rid

    def _tokens(self, length: int) -> list[int]:
        """Seeded pseudo-random prompt tokens (`seed`: another draw), different for every
        request: identical rows would route every token of a mixture of experts to the same
        experts (a step reading top_k experts per layer whatever its batch), which no live
        batch does."""
        spec = getattr(self.engine, "spec", None)
        vocab = int(getattr(spec, "vocab_size", 0) or 2)
        rng = random.Random(f"{self.seed}:{self.n}")
        return [rng.randrange(1, vocab) for _ in range(length)]

    def fits(self, prefill: int, decodes: int, context: int) -> bool:
        need = ceil_div(prefill + 8, self.bs) + decodes * ceil_div(context + 8, self.bs)
        return (
            need <= len(self.free)
            and prefill + 8 <= self.engine.max_model_len
            and context + 8 <= self.engine.max_model_len
        )

    def time(self, prefill: int, decodes: int, context: int, reps: int) -> dict[str, Any]:
        """Median time of a batch: one fresh prefill of `prefill` tokens + `decodes` decodes
        at `context` tokens of KV each."""
        self._computed = {}
        setup = SchedulerOutput(0)
        dec = [self._new(setup, context, context - 1) for _ in range(decodes)]
        self.engine.step(setup)  # admit, nothing scheduled
        for rid in dec:
            self.engine.requests[rid].num_computed = context - 1
        times = []
        for rep in range(reps + 1):  # first run is warm-up
            step = SchedulerOutput(rep + 1, num_scheduled_tokens=dict.fromkeys(dec, 1))
            if prefill:
                step.num_scheduled_tokens[self._new(step, prefill, 0)] = prefill
            start = time.perf_counter()
            self.engine.step(step)
            times.append(time.perf_counter() - start)
            self._release([r for r in step.num_scheduled_tokens if r not in dec])
        self._release(dec)
        ctx = decodes * context + prefill
        return {
            "prefill_tokens": prefill,
            "decode_tokens": decodes,
            "context_tokens": ctx,
            "time_s": statistics.median(times[1:]),
        }

    def time_decodes(
        self, contexts: list[int], variants: dict[str, Callable[[SteppingEngine], Any]], reps: int
    ) -> dict[str, float]:
        """Median decode-step time of one decode per context in `contexts`, for each variant
        {name: callable(engine)} applied before its runs; variants are interleaved so machine
        drift hits them alike."""
        self._computed = {}
        setup = SchedulerOutput(0)
        dec = [self._new(setup, c, c - 1) for c in contexts]
        self.engine.step(setup)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(reps + 1):  # first round is warm-up
            for name, apply in variants.items():
                for rid, c in zip(dec, contexts):  # every run decodes at the same context
                    self.engine.requests[rid].num_computed = c - 1
                apply(self.engine)
                start = time.perf_counter()
                self.engine.step(
                    SchedulerOutput(rep + 1, num_scheduled_tokens=dict.fromkeys(dec, 1))
                )
                if rep:
                    times[name].append(time.perf_counter() - start)
        self._release(dec)
        return {name: statistics.median(t) for name, t in times.items()}

    def _release(self, rids: list[str]) -> None:
        if rids:
            self.engine.step(SchedulerOutput(0, free_request_ids=rids))
            for rid in rids:
                self.free.extend(reversed(self._computed.pop(rid)[1]))


def _grid(cfg: dict) -> list[tuple[int, int, int]]:
    points = [(p, 0, 0) for p in cfg["prefill"]]
    points += [(0, n, c) for n, c in product(cfg["decode"], cfg["context"])]
    return points + list(cfg["mixed"])


def fit(samples: list[dict[str, Any]], experts: Experts | None = None) -> dict[str, Any]:
    """Least-squares cost model, ALISE's T0/alpha/beta, pivot and fit error from samples;
    `experts` (a mixture of experts): the c_expert column, the experts each batch reads."""
    x = np.array(
        [
            [1, s["prefill_tokens"], s["decode_tokens"], s["context_tokens"]]
            + ([experts.read(s["prefill_tokens"] + s["decode_tokens"])] if experts else [])
            for s in samples
        ],
        dtype=float,
    )
    t = np.array([s["time_s"] for s in samples])
    coef, _ = nnls(x / t[:, None], np.ones_like(t))  # minimize relative error
    pred = x @ coef
    pre = [s for s in samples if s["decode_tokens"] == 0]
    dec = [s for s in samples if s["prefill_tokens"] == 0]
    t0 = sum(s["prefill_tokens"] * s["time_s"] for s in pre) / sum(
        s["prefill_tokens"] ** 2 for s in pre
    )
    a = np.array([[s["context_tokens"], s["decode_tokens"]] for s in dec], dtype=float)
    (alpha, beta), _ = nnls(a, np.array([s["time_s"] for s in dec]))
    best = max(s["prefill_tokens"] / s["time_s"] for s in pre)
    pivot = min(
        (s for s in pre if s["prefill_tokens"] / s["time_s"] >= SATURATION * best),
        key=lambda s: s["prefill_tokens"],
    )
    return {
        "coefficients": dict(
            zip(("c0", "c_prefill", "c_decode", "c_context", "c_expert"), map(float, coef))
        ),
        "moe": experts.to_profile() if experts else None,
        "t0": t0,
        "alpha": float(alpha),
        "beta": float(beta),
        "pivot_tokens": pivot["prefill_tokens"],
        "pivot_time_s": pivot["time_s"],
        "fit_error": float(np.sqrt(np.mean(((pred - t) / t) ** 2))),
    }


def profile_engine(
    engine: SteppingEngine, quick: bool = False, max_prefill: int | None = None
) -> dict[str, Any]:
    """Run the grid (QUICK or FULL) on an idle engine and return the profile JSON dict.
    `max_prefill` drops batches with more prefill tokens (fit the regime you serve: on CPU
    the linear model fits short prompts badly when 2K-token prefills dominate the fit)."""
    if engine.requests:
        raise ValueError("the executor is serving requests: profile an idle executor")
    cfg = QUICK if quick else FULL
    bench = StepTimer(engine)
    with engine.exclusive():
        samples = [
            bench.time(p, d, c, cfg["reps"]) for p, d, c in grid_points(bench, quick, max_prefill)
        ]
    return profile_from_samples(engine, samples, quick, max_prefill)


def grid_points(
    bench: StepTimer, quick: bool = False, max_prefill: int | None = None
) -> list[tuple[int, int, int]]:
    """The grid's (prefill, decodes, context) batches this engine holds."""
    cfg = QUICK if quick else FULL
    grid = [(p, d, c) for p, d, c in _grid(cfg) if max_prefill is None or p <= max_prefill]
    return [g for g in grid if bench.fits(*g)]


def profile_from_samples(
    engine: SteppingEngine, samples: list[dict[str, Any]], quick: bool, max_prefill: int | None
) -> dict[str, Any]:
    """The profile JSON dict of timed grid samples (profile_engine's, or a benchmark's)."""
    info = engine.describe()
    return {
        "device": info["device"],
        "model": info["model"],
        "architecture": info["architecture"],
        "weights": info["weights"],
        "threads": torch.get_num_threads(),
        "params": parameter_counts(engine),
        **fit(samples, experts_of(engine.spec)),
        "samples": samples,
        "block_size": engine.block_size,
        "num_device_blocks": engine.num_device_blocks,
        "num_host_blocks": engine.num_host_blocks,
        "dtype": info["dtype"],
        "kv_dtype": info["kv_dtype"],
        "quick": quick,
        "max_prefill": max_prefill,
    }


def experts_of(spec: Any) -> Experts | None:
    """The cost model's routing figures of a mixture-of-experts model (None: dense)."""
    moe = spec.variant.moe
    if moe is None:
        return None
    return Experts(moe.num_experts, moe.top_k, sum(moe.sparse_layers))


WEIGHT_BYTES = {"fp8": 1, "int8": 1, "int4": 0.5}  # per parameter, by Engine.weight_format


def parameter_counts(engine: Any) -> dict[str, Any]:
    """Parameters in all and read per token (a mixture of experts reads only the routed
    experts), and the bytes per token of the weights as served (FP8 and INT8: one per
    parameter, INT4: half; scales and the unpacked embeddings and norms not counted apart)."""
    from services.executor.wquant import Fp8Weight, Int4Weight, Int8Weight

    runner, packed = engine.runner, (Int4Weight, Int8Weight, Fp8Weight)
    tensors = [t for t in vars(runner).values() if isinstance(t, torch.Tensor)]
    tensors += [
        t for layer in runner.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)
    ]
    dense = sum(t.numel() for t in {id(t): t for t in tensors}.values())
    dense += sum(
        w.shape[0] * w.shape[1]
        for layer in runner.layers
        for w in vars(layer).values()
        if isinstance(w, packed)
    )
    experts = [getattr(layer, "moe", None) for layer in runner.layers]
    routed = [m for m in experts if m is not None]
    per_expert = [(m.gate_up[0].numel() + m.down[0].numel(), m) for m in routed]
    total = dense + sum(n * m.num_experts + m.router.numel() for n, m in per_expert)
    active = dense + sum(n * m.top_k + m.router.numel() for n, m in per_expert)
    size = WEIGHT_BYTES.get(
        engine.weight_format, torch.empty((), dtype=engine.dtype).element_size()
    )
    return {"total": total, "active_per_token": active, "bytes_per_param": size,
            "weight_bytes_per_token": active * size}  # fmt: skip


def write_profile(profile: dict[str, Any], path: str | Path) -> None:
    """The profile JSON as `alise executor profile`, Describe and the fidelity check read it."""
    Path(path).write_text(json.dumps(profile, indent=2) + "\n")


def summary(profile: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in profile.items() if k != "samples"} | {
        "num_samples": len(profile["samples"])
    }
