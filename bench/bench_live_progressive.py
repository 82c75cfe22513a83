"""`alise bench live-progressive`: issue 30's live acceptance on this machine's real stack.

Every point is (rate, temperature, repeat, policy): `alise serve --policy P` started afresh
(`bench_serve.LiveStack`), the ShareGPT test prompts replayed over HTTP SSE (`bench/live.py`)
with honest defaults: one `max_tokens` (256) for every request, EOS honoured, the real
predictor. `fcfs` and `hybrid` run at every point; `sarathi` and `alise` once per (rate,
temperature), at repeat 0. A repeat is another arrival draw (trace seed `seed + repeat`) and,
at temperature > 0, other samples (`--paired-seeds`: request i of repeat r sends the seed
`r * 1_000_003 + i`, so the policies of one repeat get the same draws, up to the numerics of
their batches).

Each stack's predictor starts from its calibration seed alone (`--fresh-store`, default): its
store lives in a data dir of the run's own (the models, the tokenized traces, the embedding
cache and the MLP checkpoints linked from the shared one), so what an earlier run taught it
about these very prompts does not leak into the next (a prompt it has seen retrieves its own
length: an oracle).

Each point's `ceiling_mean_normalized_latency` is what ordering alone could win on that point's
own trace (arrivals, prompt and output lengths as served): the simulator, with the CPU profile
and oracle lengths, at the best hybrid configuration it finds (`ceiling.best_hybrid`),
beside fcfs simulated on the same trace (`sim_fcfs_mean_normalized_latency`).

Writes `--json` (default bench/results/live_progressive.json): a list of points, each with
`rate`, `temperature`, `repeat`, `policy`, `mean_normalized_latency`, `p99_tbt_s`, the
ceiling, and `over_repeats` (mean, min, max, n of the two metrics over the repeats of its
rate, temperature and policy); beside it `<stem>_meta.json` (command, configuration, the
per-group summary and hybrid's share of the ceiling gain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_POLICY_CONFIG = {"hybrid": {"token_budget": 128}, "sarathi": {"token_budget": 128}}
LINKED = ("models", "traces")  # shared data-dir entries a fresh run links (not its store)


def fresh_data_dir(shared: Path, dest: Path) -> Path:
    """A data dir for one stack: the shared models and traces linked, an empty store, the
    embedding cache and MLP checkpoints linked (so the seed costs no embedding or training)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if (shared / name).exists() and not (dest / name).exists():
            os.symlink(shared / name, dest / name)
    pred = dest / "predictor"
    pred.mkdir(exist_ok=True)
    for src in (shared / "predictor").glob("*"):
        if (src.name == "embeddings" or src.suffix == ".pt") and not (pred / src.name).exists():
            os.symlink(src, pred / src.name)
    return dest


def keep_new_checkpoints(run_dir: Path, shared: Path) -> None:
    """MLP checkpoints a run had to train are copied back, so the next run loads them."""
    import shutil

    for path in (run_dir / "predictor").glob("*.pt"):
        target = shared / "predictor" / path.name
        if not path.is_symlink() and not target.exists():
            shutil.copy2(path, target)


def wait_seeded(run_dir: Path, timeout_s: float) -> float:
    """Seconds until the predictor logs that every regime's store is seeded and its MLP
    loaded or trained, or TimeoutError."""
    started = time.monotonic()
    log = run_dir / "predictor.log"
    while time.monotonic() - started < timeout_s:
        if log.exists() and "seeding finished" in log.read_text(errors="replace"):
            return time.monotonic() - started
        time.sleep(1.0)
    raise TimeoutError(f"the predictor's store was not seeded within {timeout_s:.0f} s")


def plan(args: argparse.Namespace) -> list[dict]:
    """Every run, in order: (temperature, rate, repeat, policy)."""
    runs = []
    for temperature in _floats(args.temperatures):
        for rate in _floats(args.rates):
            for repeat in range(args.repeats):
                policies = _names(args.policies) + (
                    _names(args.once_policies) if not repeat else []
                )
                runs += [dict(temperature=temperature, rate=rate, repeat=repeat, policy=p)
                         for p in policies]  # fmt: skip
    return runs


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def trace_rows(results) -> list[dict]:
    """A run's own trace, as the simulator reads it (`jsonl:`): arrivals as sent, prompt and
    output lengths as served."""
    return [
        {"request_id": r.record.request_id, "arrival_s": round(r.record.arrival_s, 4),
         "prompt_len": r.record.prompt_len, "output_len": max(1, r.completion_tokens)}
        for r in results if r.error is None
    ]  # fmt: skip


def run_one(args: argparse.Namespace, run: dict, out: Path) -> tuple[dict, list[dict]]:
    """Start the stack for `run`, replay its trace, stop; (point, the run's trace rows)."""
    from bench.bench_serve import LiveStack, trace_for
    from services.common.settings import CommonSettings

    name = "{0}-t{temperature:g}-r{rate:g}-{repeat}".format(run.get("arm", run["policy"]), **run)
    env = {"ALISE_STEP_TRACE": str(out / f"steps-{name}.jsonl")}
    if args.fresh_store:
        shared = Path(CommonSettings().data_dir)
        env["ALISE_DATA_DIR"] = str(fresh_data_dir(shared, out / f"data-{name}"))
    config = json.dumps({**DEFAULT_POLICY_CONFIG, **args.configs}.get(run["policy"], {}))
    stack = LiveStack(run["policy"], out, config, name=name, env=env)
    try:
        t0 = time.monotonic()
        stack.wait_ready()
        seeded_s = wait_seeded(out / f"run-{name}", 600) if args.fresh_store else 0.0
        start_s = time.monotonic() - t0
        items = trace_for(_trace_args(args, run["repeat"]), run["rate"])
        seed = run["repeat"] if args.paired_seeds and run["temperature"] > 0 else None
        results, wall = replay(stack.url, items, run["temperature"], seed)
    finally:
        stack.stop()
        if args.fresh_store:
            keep_new_checkpoints(out / f"data-{name}", Path(CommonSettings().data_dir))
    point = point_of(run, results, args.max_tokens)
    point.update(sample_seed=seed, stack_start_s=round(start_s, 1),
                 seed_wait_s=round(seeded_s, 1), replay_s=round(wall, 1))  # fmt: skip
    point.update(record_predictions(results, Path(env["ALISE_STEP_TRACE"]), out, name))
    return point, trace_rows(results)


def record_predictions(results, steps: Path, out: Path, name: str) -> dict:
    """What the live run predicted, as the simulator replays it, keyed by the trace's request
    ids: the arrival predictions (`predictions-NAME.jsonl`, from X-ALISE-Prediction) and the
    executor's remaining-length forecasts (`forecasts-NAME.jsonl`, from the step trace).
    Returns their paths and counts (a path is None when a request has no arrival prediction
    or the probe made no forecast)."""
    from lab.sim.forecasts import forecasts_from_step_trace, write_forecasts

    done = [r for r in results if r.error is None]
    predictions = out / f"predictions-{name}.jsonl"
    known = [r for r in done if r.predicted_len is not None]
    predictions.write_text("".join(
        json.dumps({"id": r.record.request_id, "predicted_len": r.predicted_len}) + "\n"
        for r in known
    ))  # fmt: skip
    forecasts = out / f"forecasts-{name}.jsonl"
    ids = {r.served_id: r.record.request_id for r in done if r.served_id}
    rows = forecasts_from_step_trace(steps, ids) if steps.exists() else []
    n = write_forecasts(str(forecasts), rows)
    return {
        "predictions_file": str(predictions) if len(known) == len(done) else None,
        "forecasts_file": str(forecasts) if n else None,
        "forecasts_recorded": n,
    }


def sim_replay(point: dict, rows: list[dict], knobs: dict, profile: Path) -> dict:
    """The simulator on the run's own trace with the run's own predictions replayed (arrival
    predictions, then the probe's forecasts at the checkpoints where the live run made them):
    how far the simulator's figure for this policy is from the live one with real forecasts."""
    from bench.live_ceiling import simulate_mnl

    if not (point.get("predictions_file") and point.get("forecasts_file")):
        return {"sim_replay_mean_normalized_latency": None}
    arrival = f"file:{point['predictions_file']}"
    spec = f"{arrival}+replay:{point['forecasts_file']}"
    return {
        "sim_replay_mean_normalized_latency": simulate_mnl(
            rows, point["policy"], knobs, profile, prediction=spec
        ),
        "sim_replay_prediction": spec,
        # the same without the forecasts: what the probe's refinements change in the simulator
        "sim_arrival_only_mean_normalized_latency": simulate_mnl(
            rows, point["policy"], knobs, profile, prediction=arrival
        ),
    }


def _trace_args(args: argparse.Namespace, repeat: int) -> argparse.Namespace:
    """`bench_serve.trace_for`'s arguments for a repeat (its own arrival seed)."""
    return argparse.Namespace(
        dataset=args.dataset, num_prompts=args.num_prompts, arrival="poisson", burstiness=1.0,
        slo=None, seed=args.seed + repeat, max_prompt=args.max_prompt,
        max_tokens=args.max_tokens, max_tokens_mode="fixed",
    )  # fmt: skip


def replay(url: str, items, temperature: float, sample_seed: int | None):
    """(results, wall seconds) of one trace at `temperature`, EOS honoured."""
    import asyncio

    from bench.live import run_trace, served_model

    model = asyncio.run(served_model(url))
    started = time.monotonic()
    results = asyncio.run(
        run_trace(url, items, model, ignore_eos=False, temperature=temperature,
                  sample_seed=sample_seed)
    )  # fmt: skip
    return results, time.monotonic() - started


def point_of(run: dict, results, max_tokens: int) -> dict:
    from lab.workload.metrics import summarize

    s = summarize([r.record for r in results])
    return {
        **run,
        "mean_normalized_latency": s.get("mean_normalized_latency"),
        "p99_tbt_s": s.get("p99_tbt"),
        "median_ttft_s": s.get("median_ttft"),
        "mean_e2e_s": s.get("mean_e2e"),
        "completed": s.get("completed"),
        "num_errors": sum(1 for r in results if r.error),
        "capped_share": _capped_share(results, max_tokens),
    }


def _capped_share(results, max_tokens: int) -> float | None:
    """Share of the answers that ran to `max_tokens`."""
    done = [r for r in results if r.error is None]
    if not done:
        return None
    return round(sum(r.completion_tokens >= max_tokens for r in done) / len(done), 3)


def over_repeats(points: list[dict]) -> None:
    """Adds `over_repeats` to each point: mean, min, max and n of its metrics over the
    repeats of its (rate, temperature, policy)."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["rate"], p["temperature"], p["policy"]), []).append(p)
    for group in groups.values():
        spread = {}
        for key in ("mean_normalized_latency", "p99_tbt_s"):
            values = [p[key] for p in group if p[key] is not None]
            spread[key] = {"mean": statistics.fmean(values) if values else None,
                           "min": min(values, default=None), "max": max(values, default=None),
                           "n": len(values)}  # fmt: skip
        for p in group:
            p["over_repeats"] = spread


def verdicts(points: list[dict], floor: float = 0.05) -> list[dict]:
    """Per (rate, temperature, repeat): hybrid's share of the ceiling's gain over fcfs (the
    ceiling's gain counted as at least `floor` of fcfs's value) and its P99 TBT over fcfs's;
    the acceptance asks >= 0.8 and <= 0.5 at every point."""
    by = {(p["rate"], p["temperature"], p["repeat"], p["policy"]): p for p in points}
    out = []
    for (rate, temp, rep, policy), hybrid in by.items():
        fcfs = by.get((rate, temp, rep, "fcfs"))
        if policy != "hybrid" or fcfs is None or not fcfs["mean_normalized_latency"]:
            continue
        gain = 1.0 - hybrid["mean_normalized_latency"] / fcfs["mean_normalized_latency"]
        ceiling = max(hybrid.get("ceiling_gain") or 0.0, floor)
        tbt = hybrid["p99_tbt_s"] / fcfs["p99_tbt_s"] if fcfs["p99_tbt_s"] else None
        out.append({"rate": rate, "temperature": temp, "repeat": rep, "hybrid_gain": gain,
                    "ceiling_gain_floored": ceiling, "share_of_ceiling": gain / ceiling,
                    "p99_tbt_vs_fcfs": tbt, "met": gain / ceiling >= 0.8 and tbt is not None
                    and tbt <= 0.5})  # fmt: skip
    return out


def _run(args: argparse.Namespace) -> int:
    from bench.live_ceiling import best_hybrid, served_profile

    args.configs = _configs(args.policy_config)
    out = Path(args.out).resolve()  # absolute: Redis runs in its own folder
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else served_profile()
    runs = plan(args)
    print(f"{len(runs)} runs: {[r['policy'] for r in runs]}", file=sys.stderr, flush=True)
    points = []
    for run in runs:
        point, rows = run_one(args, run, out)
        name = "{policy}-t{temperature:g}-r{rate:g}-{repeat}".format(**run)
        trace = out / f"trace-{name}.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
        point["trace"] = str(trace)
        if args.ceiling and rows:
            point.update(best_hybrid(rows, profile))
        if args.sim_replay and rows and run["policy"] != "fcfs":
            knobs = {**DEFAULT_POLICY_CONFIG, **args.configs}.get(run["policy"], {})
            point.update(sim_replay(point, rows, knobs, profile))
        points.append(point)
        print(json.dumps({k: point.get(k) for k in SHOWN}), file=sys.stderr, flush=True)
    over_repeats(points)
    text = json.dumps(points, indent=2, default=str)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    config = {k: v for k, v in vars(args).items() if k != "func" and not k.startswith("_")}
    meta = {"command": "alise " + " ".join(sys.argv[1:]), "config": config,
            "verdicts": verdicts(points), "machine": "shared 2-core CPU host (nice'd; other "
            "jobs ran beside it)"}  # fmt: skip
    if args.json:
        Path(args.json).with_name(Path(args.json).stem + "_meta.json").write_text(
            json.dumps(meta, indent=2, default=str)
        )
    return 0 if all(p["num_errors"] == 0 for p in points) else 1


SHOWN = ("policy", "rate", "temperature", "repeat", "mean_normalized_latency", "p99_tbt_s",
         "ceiling_mean_normalized_latency", "num_errors", "stack_start_s", "replay_s")  # fmt: skip


def _configs(specs: list[str] | None) -> dict[str, dict]:
    from bench.bench_serve import policy_configs

    return {p: json.loads(v) for p, v in policy_configs(specs).items()}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "live-progressive", help="issue 30's live acceptance: rates x temperatures x repeats"
    )
    p.add_argument("--rates", default="1,3")
    p.add_argument("--temperatures", default="1,0", help="1.0 = the API default; 0 = greedy")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policies", default="fcfs,hybrid", help="run at every point")
    p.add_argument("--once-policies", default="sarathi,alise", help="run at repeat 0 only")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", default="sharegpt:split=test")
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256, help="every request's max_tokens")
    p.add_argument("--seed", type=int, default=0, help="arrival seed of repeat 0")
    p.add_argument(
        "--policy-config", action="append", metavar="POLICY=JSON",
        help=f"knobs for a policy (default {json.dumps(DEFAULT_POLICY_CONFIG)})",
    )  # fmt: skip
    p.add_argument("--no-fresh-store", dest="fresh_store", action="store_false",
                   help="let every stack use (and teach) the shared predictor store")  # fmt: skip
    p.add_argument("--no-paired-seeds", dest="paired_seeds", action="store_false",
                   help="unseeded sampling (policies then get different draws)")  # fmt: skip
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false")
    p.add_argument("--no-sim-replay", dest="sim_replay", action="store_false",
                   help="skip simulating each run with its own recorded predictions")  # fmt: skip
    p.add_argument("--profile", default=None, help="simulator profile of the ceiling")
    p.add_argument("--out", default="results/live-progressive", help="logs, traces")
    p.add_argument("--json", default="bench/results/live_progressive.json")
    p.set_defaults(func=_run)
