"""`alise bench live-robust`: hybrid against fcfs on the live stack, with the noise measured.

Every run is (temperature, rate, seed, arm): `alise serve` with its defaults started afresh
(the predictor from its calibration seed alone), the ShareGPT test prompts replayed at a Poisson
rate over HTTP SSE with one `max_tokens` cap for every request, EOS honoured, the real
predictor (`bench_live_progressive.run_one`). The arms: `fcfs`, `fcfs_aa` (fcfs again on the
same trace and sample seeds: the A/A run that says how far two runs of one policy land apart)
and `hybrid`. A seed is one draw of the arrival process (and, at temperature > 0, of the
samples: the arms of one seed share them).

The benchmark resumes: runs already in `--json` are kept and skipped, each new one is appended
as it finishes, so the grid can be spread over sessions. Beside every hybrid run, what ordering
could have won on its own trace (the simulator, the bundled CPU profile, the best hybrid
configuration of the ceiling grid):
- `ceiling_oracle`: oracle lengths;
- `ceiling_state_forecast`: each request predicted by the median of the lengths its prompt got
  in the other seeds' runs at the same temperature (draws of the very distribution the model
  samples from: the most a predictor that knows the distribution, not the draw, can know;
  at temperature 0 it equals the oracle); filled once two other seeds exist;
- `ceiling_served_predictor`: the predictions the live run was served (arrival predictions and
  the probe's forecasts, replayed);
- `sim_fcfs`: fcfs in the simulator on the same trace (fcfs over the oracle ceiling is the
  headroom: near 1, parity is the expected result).

`summary` (in `<json stem>_summary.json`) gives, per (rate, temperature), the paired ratios
over seeds with 95% intervals (t distribution): A/A (fcfs_aa / fcfs) and hybrid / fcfs, for
mean normalized latency and P99 TBT, fcfs's own upper 95% bound, and the verdicts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from bench.bench_live_progressive import _floats

ARMS = ("fcfs", "fcfs_aa", "hybrid")
KEY = ("temperature", "rate", "seed", "arm")
MIN_OTHER_SEEDS = 2  # other seeds' draws a state-forecast prediction needs


def policy_of(arm: str) -> str:
    return arm.removesuffix("_aa")


def key_of(point: dict) -> tuple:
    return tuple(point[k] for k in KEY)


def plan(args: argparse.Namespace, done: set[tuple]) -> list[dict]:
    """The runs still missing, seed by seed (so an interrupted grid has whole seeds first)."""
    runs = []
    for seed in range(args.seeds):
        for temperature in _floats(args.temperatures):
            for rate in _floats(args.rates):
                for arm in _names(args.arms):
                    run = {"temperature": temperature, "rate": rate, "seed": seed, "arm": arm}
                    if key_of(run) not in done:
                        runs.append(run)
    return runs


def load_points(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def save_points(path: Path, points: list[dict]) -> None:
    points.sort(key=key_of)
    path.write_text(json.dumps(points, indent=1, default=str) + "\n")


# -- one run ------------------------------------------------------------------------------------
def run_point(args: argparse.Namespace, run: dict, out: Path, profile: Path) -> dict:
    """Serve `run`, then its ceilings (hybrid) and its served rows."""
    from bench.bench_live_progressive import run_one

    live = {**run, "policy": policy_of(run["arm"]), "repeat": run["seed"]}
    point, rows = run_one(args, live, out)
    point.pop("repeat", None)
    point["code"] = code_version()
    if run["arm"] == "hybrid":  # what hybrid's defaults came to on the served profile
        point["hybrid_shape"] = dict(zip(("token_budget", "job_limit"), hybrid_shape(profile)))
    point["requests"] = {  # the run's own trace, compact: what the ceilings re-simulate
        "id": [r["request_id"] for r in rows],
        "arrival_s": [r["arrival_s"] for r in rows],
        "prompt_len": [r["prompt_len"] for r in rows],
        "output_len": [r["output_len"] for r in rows],
    }
    if run["arm"] == "hybrid" and rows:
        point.update(ceilings(point, rows, profile))
    name = "{0}-t{temperature:g}-r{rate:g}-{seed}".format(run["arm"], **run)
    point["profile_check"] = profile_check(out / f"steps-{name}.jsonl", profile)
    for name in ("predictions_file", "forecasts_file", "trace"):
        point.pop(name, None)  # paths in this machine's run folder
    return point


def best_with(rows: list[dict], profile: Path, prediction: str) -> dict:
    """The lowest mean normalized latency hybrid reaches on `rows` with `prediction`, over
    its defaults and the oracle ceiling's grid (`sim.ceiling.ceiling_grid`), and its knobs."""
    from bench.live_ceiling import simulate_mnl
    from lab.sim.ceiling import ceiling_grid

    tried = [
        (simulate_mnl(rows, "hybrid", k, profile, prediction), k) for k in [{}, *ceiling_grid()]
    ]
    mnl, knobs = min(tried, key=lambda t: t[0])
    return {"mean_normalized_latency": mnl, "knobs": knobs}


def code_version() -> str:
    """The commit the run served (with `+` when the tree had changes)."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "services"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def hybrid_shape(profile: Path) -> tuple[int, int | None]:
    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.policies.hybrid import HybridKnobs, curve_defaults

    return curve_defaults(HybridKnobs(), CostModel.from_profile(profile))


def ceilings(point: dict, rows: list[dict], profile: Path) -> dict:
    """The oracle ceiling (best hybrid of the grid), fcfs in the simulator, and the best hybrid
    of the same grid with the predictions the live run was served."""
    from bench.live_ceiling import best_hybrid

    best = best_hybrid(rows, profile)
    knobs = {k: v for k, v in best["ceiling_config"].items()
             if k not in ("policy", "prediction", "profile")}  # fmt: skip
    served = None
    if point.get("predictions_file") and point.get("forecasts_file"):
        spec = f"file:{point['predictions_file']}+replay:{point['forecasts_file']}"
        served = best_with(rows, profile, spec)
    return {
        "ceiling_oracle": best["ceiling_mean_normalized_latency"],
        "ceiling_knobs": knobs,
        "sim_fcfs": best["sim_fcfs_mean_normalized_latency"],
        "ceiling_served_predictor": None if served is None else served["mean_normalized_latency"],
        "ceiling_served_predictor_knobs": None if served is None else served["knobs"],
    }


def profile_check(steps: Path, profile: Path, batches: int = 3) -> dict | None:
    """The simulator's profile against the live engine: for the `batches` most frequent
    decode-only batch sizes of the run's step trace, the median measured step time and the
    profile's time for the same steps (the trace's own contexts); `within_10pct` says whether
    every ratio is within 10%."""
    from services.scheduler.core.cost_model import CostModel

    if not steps.exists():
        return None
    cost = CostModel.from_profile(profile)
    by_size: dict[int, list[tuple[float, float]]] = {}
    for line in steps.read_text().splitlines():
        row = json.loads(line)
        if row["prefill"] == 0 and row["decode"] > 0:
            model = cost.iteration_time(0, row["decode"], row["context"])
            by_size.setdefault(row["decode"], []).append((row["exec_s"], model))
    common = sorted(by_size, key=lambda b: -len(by_size[b]))[:batches]
    sizes = {}
    for b in sorted(common):
        live = statistics.median(t for t, _ in by_size[b])
        model = statistics.median(m for _, m in by_size[b])
        sizes[str(b)] = {"steps": len(by_size[b]), "live_ms": round(1e3 * live, 2),
                         "profile_ms": round(1e3 * model, 2), "ratio": round(model / live, 3)}  # fmt: skip
    ok = all(abs(v["ratio"] - 1) <= 0.1 for v in sizes.values()) if sizes else None
    return {"profile": profile.name, "batches": sizes, "within_10pct": ok}


def rows_of(point: dict) -> list[dict]:
    r = point["requests"]
    return [
        {"request_id": i, "arrival_s": a, "prompt_len": p, "output_len": o}
        for i, a, p, o in zip(r["id"], r["arrival_s"], r["prompt_len"], r["output_len"])
    ]


def state_forecasts(point: dict, points: list[dict]) -> dict[str, int] | None:
    """Each request of `point` predicted by the median of its prompt's lengths in the other
    seeds' runs at the same temperature (every arm), or None with fewer than
    MIN_OTHER_SEEDS other seeds."""
    draws: dict[str, list[int]] = {}
    seeds = set()
    for p in points:
        if p["temperature"] != point["temperature"] or p["seed"] == point["seed"]:
            continue
        seeds.add(p["seed"])
        for rid, n in zip(p["requests"]["id"], p["requests"]["output_len"]):
            draws.setdefault(rid, []).append(n)
    if len(seeds) < MIN_OTHER_SEEDS:
        return None
    own = point["requests"]["id"]
    if any(rid not in draws for rid in own):
        return None
    return {rid: max(1, round(statistics.median(draws[rid]))) for rid in own}


def fill_state_ceilings(points: list[dict], profile: Path, out: Path) -> None:
    """`ceiling_state_forecast` of every hybrid point that can have one: the best hybrid of
    the grid with those predictions (recomputed when more seeds give more draws)."""
    seeds_of = {p["temperature"]: set() for p in points}
    for p in points:
        seeds_of[p["temperature"]].add(p["seed"])
    for point in points:
        if point["arm"] != "hybrid" or "ceiling_knobs" not in point:
            continue
        others = len(seeds_of[point["temperature"]] - {point["seed"]})
        if point.get("state_forecast_seeds") == others:
            continue
        table = state_forecasts(point, points)
        if table is None:
            continue
        path = out / "state-forecast-t{temperature:g}-r{rate:g}-{seed}.json".format(**point)
        path.write_text(json.dumps(table))
        best = best_with(rows_of(point), profile, f"file:{path}")
        point["ceiling_state_forecast"] = best["mean_normalized_latency"]
        point["ceiling_state_forecast_knobs"] = best["knobs"]
        point["state_forecast_seeds"] = others


# -- the summary --------------------------------------------------------------------------------
def t95(n: int) -> float:
    """Two-sided 95% Student t quantile for n - 1 degrees of freedom (n >= 2)."""
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1))


def interval(values: list[float]) -> dict | None:
    """Mean and 95% interval of the mean of `values` (None with fewer than 2)."""
    if len(values) < 2:
        return None
    m, sd = statistics.fmean(values), statistics.stdev(values)
    half = t95(len(values)) * sd / math.sqrt(len(values))
    return {"mean": m, "lo": m - half, "hi": m + half, "n": len(values)}


def ratio_interval(pairs: list[tuple[float, float]]) -> dict | None:
    """Geometric-mean ratio a/b over paired runs with its 95% interval (on log ratios)."""
    logs = [math.log(a / b) for a, b in pairs if a and b]
    got = interval(logs)
    if got is None:
        return None
    return {k: (math.exp(v) if k != "n" else v) for k, v in got.items()}


def summarize(points: list[dict]) -> list[dict]:
    """Per (rate, temperature): A/A and hybrid/fcfs paired ratios, fcfs's upper bound and
    the verdicts (never worse beyond noise; P99 TBT <= 0.6x fcfs; share of the
    state-forecast ceiling's gap captured)."""
    groups: dict[tuple, dict[int, dict[str, dict]]] = {}
    for p in points:
        seeds = groups.setdefault((p["rate"], p["temperature"]), {})
        seeds.setdefault(p["seed"], {})[p["arm"]] = p
    out = []
    for (rate, temperature), seeds in sorted(groups.items()):
        out.append({"rate": rate, "temperature": temperature, **_group(list(seeds.values()))})
    return out


def _pairs(seeds: list[dict], a: str, b: str, metric: str) -> list[tuple[float, float]]:
    return [(s[a][metric], s[b][metric]) for s in seeds if a in s and b in s]


def _group(seeds: list[dict]) -> dict:
    mnl, tbt = "mean_normalized_latency", "p99_tbt_s"
    fcfs_runs = [s[a][mnl] for s in seeds for a in ("fcfs", "fcfs_aa") if a in s]
    hybrid = [s["hybrid"][mnl] for s in seeds if "hybrid" in s]
    fcfs = interval(fcfs_runs)
    got = {
        "seeds": len(seeds),
        "fcfs_mnl": fcfs,
        "hybrid_mnl_mean": statistics.fmean(hybrid) if hybrid else None,
        "aa_mnl_ratio": ratio_interval(_pairs(seeds, "fcfs_aa", "fcfs", mnl)),
        "hybrid_mnl_ratio": ratio_interval(_pairs(seeds, "hybrid", "fcfs", mnl)),
        "aa_p99_tbt_ratio": ratio_interval(_pairs(seeds, "fcfs_aa", "fcfs", tbt)),
        "hybrid_p99_tbt_ratio": ratio_interval(_pairs(seeds, "hybrid", "fcfs", tbt)),
    }
    got["never_worse"] = (
        None if fcfs is None or not hybrid else got["hybrid_mnl_mean"] <= fcfs["hi"]
    )
    ratio = got["hybrid_p99_tbt_ratio"]
    got["p99_tbt_met"] = None if ratio is None else ratio["mean"] <= 0.6
    got.update(_capture(seeds))
    return got


def _capture(seeds: list[dict]) -> dict:
    """Hybrid's share of the gap between fcfs and the state-forecast ceiling (means over the
    seeds that have one), and the oracle headroom (sim fcfs / oracle ceiling)."""
    mnl = "mean_normalized_latency"
    have = [s for s in seeds if "fcfs" in s and s.get("hybrid", {}).get("ceiling_state_forecast")]
    heads = [s["hybrid"]["sim_fcfs"] / s["hybrid"]["ceiling_oracle"]
             for s in seeds if s.get("hybrid", {}).get("ceiling_oracle")]  # fmt: skip
    out: dict = {"oracle_headroom": statistics.fmean(heads) if heads else None}
    if not have:
        return out | {"state_ceiling_gap_captured": None}
    fcfs = statistics.fmean(s["fcfs"][mnl] for s in have)
    hybrid = statistics.fmean(s["hybrid"][mnl] for s in have)
    ceiling = statistics.fmean(s["hybrid"]["ceiling_state_forecast"] for s in have)
    gap = fcfs - ceiling
    return out | {"state_ceiling_gap_captured": (fcfs - hybrid) / gap if gap > 0 else None}


# -- command ------------------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    from bench import live_ceiling

    args.configs = {"hybrid": {}, "sarathi": {}}  # `alise serve`'s defaults, not the lab's
    out, path = Path(args.out).resolve(), Path(args.json)  # absolute: Redis runs elsewhere
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else live_ceiling.served_profile()
    points = load_points(path)
    runs = plan(args, {key_of(p) for p in points})[: args.max_runs or None]
    print(f"{len(points)} runs kept, {len(runs)} to run", file=sys.stderr, flush=True)
    errors = 0
    for run in runs:
        point = run_point(args, run, out, profile)
        errors += point["num_errors"] > 0
        points.append(point)
        save_points(path, points)
        write_summary(path, points, profile)  # after every run: a stopped grid still has one
        print(json.dumps({k: point.get(k) for k in SHOWN}), file=sys.stderr, flush=True)
    fill_state_ceilings(points, profile, out)
    save_points(path, points)
    print(json.dumps(write_summary(path, points, profile), indent=1, default=str))
    return 1 if errors else 0


def write_summary(path: Path, points: list[dict], profile: Path) -> list[dict]:
    groups = summarize(points)
    summary = {"command": "alise " + " ".join(sys.argv[1:]), "profile": str(profile),
               "runs": len(points), "groups": groups}  # fmt: skip
    path.with_name(path.stem + "_summary.json").write_text(
        json.dumps(summary, indent=1, default=str) + "\n"
    )
    return groups


SHOWN = ("arm", "rate", "temperature", "seed", "mean_normalized_latency", "p99_tbt_s",
         "ceiling_oracle", "ceiling_served_predictor", "num_errors", "replay_s")  # fmt: skip


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = set(names) - set(ARMS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown arms {sorted(unknown)}: from {ARMS}")
    return names


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "live-robust", help="hybrid vs fcfs live, with A/A runs and ceilings (resumes)"
    )
    p.add_argument("--rates", default="1,4")
    p.add_argument("--temperatures", default="1,0", help="1.0 = the API default; 0 = greedy")
    p.add_argument("--seeds", type=int, default=5, help="arrival draws per point")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--max-runs", type=int, default=0, help="stop after N new runs (0: all)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", default="sharegpt:split=test")
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256, help="every request's max_tokens")
    p.add_argument("--seed", type=int, default=0, help="arrival seed of seed 0")
    p.add_argument("--profile", default=None, help="simulator profile (default: the bundled "
                   "profile the executor serves with)")  # fmt: skip
    p.add_argument("--out", default="results/live-robust", help="logs, traces")
    p.add_argument("--json", default="bench/results/live_robust.json")
    p.set_defaults(func=_run, fresh_store=True, paired_seeds=True)
