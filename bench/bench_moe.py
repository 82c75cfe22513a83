"""`alise bench moe`: the mixture-of-experts MLP on this CPU.

- grouped: `moe_forward` (tokens sorted by expert, one grouped product per projection)
  against a per-token loop (each token's k experts one after another, the arithmetic a naive
  port runs) at batch `--batch`, on a Qwen3-30B-A3B layer's shape (128 experts, top 8,
  hidden 2048, expert width 768) and on Mixtral's routing (8 experts, top 2) at a smaller
  width; the two must agree (max |diff|, fp32), and the speedup is the ratio of medians.
- fidelity: a tiny Qwen3-MoE (lab/executor/tiny.py) profiled with `alise executor profile`'s
  quick grid, then its live decode steps at three batch sizes the grid does not hold, against
  what the cost model of that profile (the simulator's clock) predicts.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.bench_engine import _emit

SHAPES = {  # name: (experts, top_k, hidden, expert width)
    "qwen3-30b-a3b-layer": (128, 8, 2048, 768),
    "mixtral-routing": (8, 2, 1024, 1792),
}


def per_token(x, w, act):
    """The reference: every token's experts one at a time (no grouping)."""
    import torch

    from services.executor.moe import route

    top, experts = route(x, w)
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(w.top_k):
            e = int(experts[t, j])
            h = act(x[t : t + 1] @ w.gate_up[e].t())
            out[t] += float(top[t, j]) * (h @ w.down[e].t()).float()[0]
    return out.to(x.dtype)


def _median_ms(f, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def grouped(batch: int, reps: int) -> dict:
    import torch

    from services.executor.llama import gate_activation
    from services.executor.moe import MoeWeights, moe_forward

    act, out = gate_activation("silu"), {}
    gen = torch.Generator().manual_seed(0)
    for name, (e, k, h, i) in SHAPES.items():
        w = MoeWeights(
            torch.randn(e, h, generator=gen) * 0.1,
            torch.randn(e, 2 * i, h, generator=gen) * 0.02,
            torch.randn(e, h, i, generator=gen) * 0.02,
            k,
            True,
        )
        x = torch.randn(batch, h, generator=gen)
        diff = float((moe_forward(x, w, act) - per_token(x, w, act)).abs().max())
        fast = _median_ms(lambda: moe_forward(x, w, act), reps)  # noqa: B023
        slow = _median_ms(lambda: per_token(x, w, act), reps)  # noqa: B023
        out[name] = {"experts": e, "top_k": k, "hidden": h, "expert_width": i,
                     "grouped_ms": round(fast, 3), "per_token_ms": round(slow, 3),
                     "speedup": round(slow / fast, 2), "max_abs_diff": diff}  # fmt: skip
    return out


def fidelity(reps: int, batches: tuple[int, ...] = (2, 5, 12)) -> dict:
    import tempfile
    from pathlib import Path

    from lab.executor.tiny import make_tiny_model
    from services.executor.engine import Engine
    from services.executor.profiler import StepTimer
    from services.scheduler.core.cost_model import CostModel

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "qwen3_moe", "qwen3_moe", seed=3, head_dim=64)
        engine = Engine(model_dir, device="cpu", dtype="fp32", num_device_blocks=256)
        profile = engine.profile(quick=True)
        model = CostModel.from_profile(profile)
        rows = {}
        for b in batches:
            with engine.exclusive():
                live = StepTimer(engine).time(0, b, 96, reps)["time_s"]
            predicted = model.iteration_time(0, b, b * 96)
            rows[str(b)] = {"live_ms": round(1e3 * live, 3),
                            "simulated_ms": round(1e3 * predicted, 3),
                            "error": round(predicted / live - 1, 4)}  # fmt: skip
        engine.close()
    return {"profile_moe": profile["moe"], "c_expert": profile["coefficients"]["c_expert"],
            "decode_steps_at_context_96": rows}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    return {
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "grouped_vs_per_token": grouped(args.batch, args.reps),
        "simulator_vs_live": fidelity(args.reps),
    }


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("moe", help="MoE: grouped experts vs a per-token loop; fidelity")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--batch", type=int, default=32, help="tokens in the step (32)")
    p.add_argument("--reps", type=int, default=7, help="repetitions (7)")
    p.set_defaults(func=lambda a: _emit(measure(a), a.json))
