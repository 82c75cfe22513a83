"""`alise bench moe`: the mixture-of-experts MLP on this CPU.

- grouped: `moe_forward` (tokens sorted by expert, one grouped product per projection)
  against a per-token loop (each token's k experts one after another, the arithmetic a naive
  port runs) at batch `--batch`, on a Qwen3-30B-A3B layer's shape (128 experts, top 8,
  hidden 2048, expert width 768) and on Mixtral's routing (8 experts, top 2) at a smaller
  width, in the executor's dtype; the two must agree (max |diff|), and the speedup is the
  ratio of medians. The reuse bounds it: 256 assignments over ~110 of 128 experts read each
  expert's weights ~2.3 times in the loop for once grouped, 64 over 8 experts 8 times.
- fidelity: a small random Qwen3-MoE (small_moe) profiled with `alise executor profile`'s
  full grid, then its live decode steps at three batch sizes and a context the grid does not
  hold, against what the simulator's clock (CostModel.measured_time of that profile) says.
  Every profiled and timed request has its own pseudo-random tokens (profiler.StepTimer), so
  a batch's rows route to different experts as live rows do; the live time is the
  median over DRAWS token draws per round (which experts a small batch reads varies with
  them), the grid and the live points timed in alternating rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.bench_engine import _emit

DRAWS = 3  # token draws per live batch size and round (each routes to its own experts)
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


def grouped(batch: int, reps: int, dtype_name: str) -> dict:
    import torch

    from services.executor.config import resolve_dtype
    from services.executor.llama import gate_activation
    from services.executor.moe import MoeWeights, moe_forward

    act, out = gate_activation("silu"), {"dtype": dtype_name}
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    out["dtype"] = str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(0)
    for name, (e, k, h, i) in SHAPES.items():
        w = MoeWeights(
            (torch.randn(e, h, generator=gen) * 0.1).to(dtype),
            (torch.randn(e, 2 * i, h, generator=gen) * 0.02).to(dtype),
            (torch.randn(e, h, i, generator=gen) * 0.02).to(dtype),
            k,
            True,
        )
        x = torch.randn(batch, h, generator=gen).to(dtype)
        diff = float((moe_forward(x, w, act).float() - per_token(x, w, act).float()).abs().max())
        fast = _median_ms(lambda: moe_forward(x, w, act), reps)  # noqa: B023
        slow = _median_ms(lambda: per_token(x, w, act), reps)  # noqa: B023
        out[name] = {"experts": e, "top_k": k, "hidden": h, "expert_width": i,
                     "grouped_ms": round(fast, 3), "per_token_ms": round(slow, 3),
                     "speedup": round(slow / fast, 2), "max_abs_diff": diff}  # fmt: skip
    return out


def small_moe(path) -> object:
    """A small random Qwen3-MoE (8 layers, 16 experts of width 256, top 4, hidden 512) whose
    decode steps take tens of milliseconds here, so machine noise stays small beside them,
    and whose experts touched grow over the batch sizes measured (4 at one token, ~16 at 12)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def fidelity(reps: int, batches: tuple[int, ...] = (2, 5, 12), rounds: int = 5) -> dict:
    """The profile's grid and the live points timed in alternating rounds (this machine's
    speed drifts over minutes: a profile measured before the live steps would carry it), the
    profile fitted on each grid point's median over the rounds."""
    import tempfile
    from pathlib import Path

    from services.executor.engine import Engine
    from services.executor.profiler import StepTimer, grid_points, profile_from_samples
    from services.scheduler.core.cost_model import CostModel

    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(small_moe(Path(tmp) / "moe"), device="cpu", num_device_blocks=512)
        grid_timer = StepTimer(engine)
        grid = grid_points(grid_timer, max_prefill=256)  # the full grid, the decode regime
        timed: dict[tuple[int, int, int], list[dict]] = {g: [] for g in grid}
        live: dict[int, list[float]] = {b: [] for b in batches}
        with engine.exclusive():
            for r in range(rounds):
                for g in grid:
                    timed[g].append(grid_timer.time(*g, reps=1))
                for b in batches:  # a fresh token draw per round: routing varies with it
                    seeds = range(1 + r * DRAWS, 1 + (r + 1) * DRAWS)
                    live[b] += [StepTimer(engine, s).time(0, b, 96, reps)["time_s"] for s in seeds]
        samples = [
            runs[0] | {"time_s": statistics.median(x["time_s"] for x in runs)}
            for runs in timed.values()
        ]
        profile = profile_from_samples(engine, samples, quick=False, max_prefill=256)
        model = CostModel.from_profile(profile)
        engine.close()
    return {"profile_moe": profile["moe"], "c_expert": profile["coefficients"]["c_expert"],
            "fit_error": profile["fit_error"], "dtype": profile["dtype"], "rounds": rounds,
            "decode_steps_at_context_96": {str(b): _row(model, b, live[b]) for b in batches}}  # fmt: skip


def _row(model, batch: int, live: list[float]) -> dict:
    median = statistics.median(live)  # over draws and rounds: machine hiccups do not move it
    predicted = model.measured_time(0, batch, batch * 96)  # the simulator's clock
    return {"live_ms": round(1e3 * median, 3),
            "live_spread_ms": [round(1e3 * min(live), 3), round(1e3 * max(live), 3)],
            "simulated_ms": round(1e3 * predicted, 3),
            "fitted_ms": round(1e3 * model.iteration_time(0, batch, batch * 96), 3),
            "error": round(predicted / median - 1, 4)}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    return {
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "grouped_vs_per_token": grouped(args.batch, args.reps, args.dtype),
        "simulator_vs_live": fidelity(args.reps),
    }


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("moe", help="MoE: grouped experts vs a per-token loop; fidelity")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--batch", type=int, default=32, help="tokens in the step (32)")
    p.add_argument("--reps", type=int, default=7, help="repetitions (7)")
    p.add_argument("--dtype", default="auto", help="model dtype (the executor's auto)")
    p.set_defaults(func=lambda a: _emit(measure(a), a.json))
