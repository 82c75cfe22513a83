"""`alise bench sampling`: what sampling costs a step, temperature 1 (the API's default)
against greedy.

- sampler: `sample` alone (the CPU engine's sampler) on [B, V] logits, B = 1, 32, 128,
  V = the bundled model's 49,152, one thread: greedy, temperature 1, and an ablation row
  with top-p 0.9 (a sort of the rows whose mass lies past the best candidates). The best of
  `--reps` runs, the variants interleaved.
- engine: one decode step of B requests at `--context` tokens of context on the bundled model
  (the executor's default dtype), every request at temperature 0 or at temperature 1, the two
  interleaved step by step on one engine (StepTimer.time_decodes); the ratio t1 / t0 is what
  temperature 1 costs a decode step.
"""

from __future__ import annotations

import argparse
import time

from bench.bench_engine import _emit

BATCHES = (1, 32, 128)


def _params(kind: str):
    from services.common.sampling import SamplingParams

    return {
        "greedy": SamplingParams(),
        "t1": SamplingParams(temperature=1.0),
        "t1_top_p_0.9": SamplingParams(temperature=1.0, top_p=0.9),
    }[kind]


def sampler_ms(vocab: int, reps: int) -> dict:
    import torch

    from services.executor.sampler import sample

    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for b in BATCHES:
        logits = torch.randn(b, vocab, generator=gen) * 3
        kinds = ("greedy", "t1", "t1_top_p_0.9")
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(reps):
            for kind in kinds:
                params = [_params(kind)] * b
                start = time.perf_counter()
                sample(logits, params, [0] * b)
                best[kind] = min(best[kind], 1e3 * (time.perf_counter() - start))
        out[str(b)] = {k: round(v, 3) for k, v in best.items()} | {
            "t1_over_greedy": round(best["t1"] / best["greedy"], 3)
        }
    return out


def engine_steps(batches: list[int], context: int, reps: int) -> dict:
    from services.common.models import weights_dir
    from services.common.sampling import SamplingParams
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine
    from services.executor.profiler import StepTimer

    settings = ExecutorSettings()
    engine = Engine(weights_dir(settings.model, settings.data_dir), device="cpu", num_host_blocks=1)

    def at(temperature: float):
        def apply(e) -> None:
            for state in e.requests.values():
                state.sampling = SamplingParams(temperature=temperature)

        return apply

    out: dict = {"dtype": str(engine.dtype).removeprefix("torch."), "context": context}
    for b in batches:
        with engine.exclusive():
            t = StepTimer(engine).time_decodes([context] * b, {"t0": at(0.0), "t1": at(1.0)}, reps)
        out[str(b)] = {
            "t0_ms": round(1e3 * t["t0"], 2),
            "t1_ms": round(1e3 * t["t1"], 2),
            "t1_over_t0": round(t["t1"] / t["t0"], 3),
        }
    engine.close()
    return out


def measure(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    return {
        "threads": torch.get_num_threads(),
        "vocab": args.vocab,
        "sampler_ms": sampler_ms(args.vocab, args.reps),
        "engine_decode_step": engine_steps([32, 128], args.context, args.reps),
    }


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sampling", help="sampling cost: temperature 1 against greedy")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--vocab", type=int, default=49152, help="logits per row (SmolLM2's)")
    p.add_argument("--context", type=int, default=256, help="tokens of context per decode")
    p.add_argument("--reps", type=int, default=7, help="repetitions (7)")
    p.set_defaults(func=lambda a: _emit(measure(a), a.json))
