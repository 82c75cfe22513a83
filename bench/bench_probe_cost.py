"""`alise bench probe-cost`: what the executor's remaining-length probe
(services/executor/probe.py) costs per step, against the step it rides on.

The bundled model in the serving dtype, B decoding requests (64-token prompts) with their
output counts staggered so that B/16 of them reach a checkpoint each step, as in steady
serving with `predict_every` 16. Per decode step, timed inside the engine: the probe's whole
part (entropy and P(EOS) of every sampled row, the rolling state, the feature vectors and one
batched probe call for the rows at a checkpoint) and the whole step. The probe is the shipped
one for the model's cap-256 sampled regime, or a random one of the same shape when none is
shipped (the cost does not depend on the weights).

Figures per B: median step ms, median probe ms, their ratio (`share`), and `share_max`
(every request at a checkpoint every step: `predict_every` 1, the worst case); and the net
cost, `net_share`: the median step with the probe on over the median step with it off, two
interleaved runs each (the sampler then draws temperature-1 rows from the probe's
probabilities instead of a softmax of its own, which the probe's own time does not show). Each batch
size gets an untimed warm-up pass first (the first pass at a new batch size measured
several times slower probe parts, allocation of the new shapes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.bench_engine import _emit

PROMPT, EVERY = 64, 16


def _probe_for(engine: Any) -> Any:
    import numpy as np

    from services.executor.probe import SCALAR_NAMES, Probe, ProbeBank, feature_names

    bank = ProbeBank.for_model(engine.model_name)
    if bank is not None and bank.pick(256, 1.0) is not None:
        return bank
    width = len(SCALAR_NAMES) + engine.spec.hidden_size
    rng = np.random.default_rng(0)
    arrays = {
        "mean": np.zeros(width, np.float32),
        "std": np.ones(width, np.float32),
        "w0": rng.normal(scale=0.05, size=(width, 64)).astype(np.float32),
        "b0": np.zeros(64, np.float32),
        "w1": rng.normal(scale=0.05, size=(64, 4)).astype(np.float32),
        "b1": np.zeros(4, np.float32),
    }
    meta = {"model": engine.model_name, "cap": 256, "regime": "t1", "names": feature_names(width)}
    return ProbeBank([Probe(arrays, meta)])


def _timed(hook: Any, spent: list[float]) -> None:
    """Wrap hook.observe to add its time of each step to `spent`."""
    observe = hook.observe

    def timed(*a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        observe(*a, **k)
        spent.append(time.perf_counter() - t0)

    hook.observe = timed


def run_batch(
    engine: Any, batch: int, every: int, steps: int, tag: str, probe: bool = True
) -> dict:
    """`steps` decode steps of `batch` requests with the probe on (checkpoint every `every`)
    or off (`probe` False: the step as without a probe; `step_s` lists every step's time)."""
    from services.common.arith import ceil_div
    from services.common.sampling import SamplingParams
    from services.common.step import NewRequestData, SchedulerOutput
    from services.executor.probe import ProbeHook

    spent: list[float] = []
    engine.probe = None
    if probe:
        eos = list(engine.spec.eos_token_ids)
        engine.probe = ProbeHook(every, _probe_for(engine), False, eos)
        _timed(engine.probe, spent)
    per = ceil_div(PROMPT + 16 + every + steps + 2, engine.block_size)
    ids = [f"{tag}{i}" for i in range(batch)]
    first = SchedulerOutput(0)
    for i, rid in enumerate(ids):
        out_n = 16 + (i % every)  # staggered: batch/every requests at a checkpoint per step
        prompt = [(7 * i + j) % 1000 + 100 for j in range(PROMPT + out_n)]
        first.new_requests.append(
            NewRequestData(rid, prompt, SamplingParams(temperature=1.0, seed=i), out_n, 0, 256)
        )
        first.block_tables[rid] = (list(range(i * per, (i + 1) * per)), False)
        first.num_scheduled_tokens[rid] = len(prompt)
    engine.step(first)
    step_s, probe_s = [], []
    for s in range(steps):
        spent.clear()
        out = engine.step(SchedulerOutput(s + 1, num_scheduled_tokens=dict.fromkeys(ids, 1)))
        step_s.append(out.timings.total_s)
        probe_s.append(sum(spent))
    engine.step(SchedulerOutput(steps + 1, free_request_ids=ids))
    warm = steps // 5
    step_ms = 1e3 * statistics.median(step_s[warm:])
    probe_ms = 1e3 * statistics.median(probe_s[warm:])
    return {"step_ms": round(step_ms, 3), "probe_ms": round(probe_ms, 4),
            "share": round(probe_ms / step_ms, 5), "step_s": step_s[warm:]}  # fmt: skip


def net_cost(engine: Any, batch: int, steps: int, rounds: int = 2) -> dict:
    """The probe's net cost: median step time with it on against off, `rounds` interleaved
    runs each. Net of what the sampler saves by drawing temperature-1 rows from the probe's
    probabilities (the exp pass both need), which `probe_ms` does not see."""
    on: list[float] = []
    off: list[float] = []
    for r in range(rounds):
        on += run_batch(engine, batch, EVERY, steps, f"n{batch}-{r}-")["step_s"]
        off += run_batch(engine, batch, EVERY, steps, f"f{batch}-{r}-", probe=False)["step_s"]
    on_ms, off_ms = 1e3 * statistics.median(on), 1e3 * statistics.median(off)
    return {"step_ms_probe_off": round(off_ms, 3), "step_ms_probe_on": round(on_ms, 3),
            "net_share": round(on_ms / off_ms - 1.0, 5)}  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    import torch

    from services.common.models import served_model_id, weights_dir
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

    torch.set_num_threads(args.threads)
    settings = ExecutorSettings()
    engine = Engine(
        weights_dir(settings.model, settings.data_dir),
        model_name=served_model_id(settings.model),
        device="cpu",
        num_device_blocks=2048,
    )
    result: dict[str, Any] = {
        "model": engine.model_name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": args.threads,
        "steps": args.steps,
        "predict_every": EVERY,
        "cpu_count": os.cpu_count(),
        "note": "2-core machine shared with other jobs (nice 5): absolute times are noisy; "
        "each share is a ratio within the same steps",
        "batches": {},
    }
    for b in args.batches:
        run_batch(engine, b, EVERY, 8, f"u{b}-")  # warm-up: the first pass at a new size is slow
        typical = run_batch(engine, b, EVERY, args.steps, f"t{b}-")
        worst = run_batch(engine, b, 1, args.steps, f"w{b}-")
        typical.pop("step_s")
        result["batches"][b] = {**typical, "share_max": worst["share"],
                                "probe_ms_max": worst["probe_ms"],
                                **net_cost(engine, b, args.steps)}  # fmt: skip
    result["max_share"] = max(v["share"] for v in result["batches"].values())
    result["max_net_share"] = max(v["net_share"] for v in result["batches"].values())
    return _emit(result, args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("probe-cost", help="remaining-length probe cost per decode step")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per batch size")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64]
    )
    p.set_defaults(func=_run)
