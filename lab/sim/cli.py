"""`alise sim run` (one policy, one rate), `alise sim sweep` (policies x rates, capacity,
plots) and `alise sim ceiling` (the best hybrid with oracle lengths on a trace). Policies are `name[:knob=value,...][@prediction]`; see docs/simulator.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lab.workload.report import emit_json


def _rates(text: str) -> list[float]:
    """`2,4,8` or `start:stop:step` (stop included)."""
    if text.count(":") == 2:
        start, stop, step = (float(x) for x in text.split(":"))
        if step <= 0 or stop < start:
            raise argparse.ArgumentTypeError(f"bad rate range {text!r}")
        n = round((stop - start) / step) + 1
        return [round(start + i * step, 6) for i in range(n)]
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad rate list {text!r}") from exc
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive")
    return sorted(set(rates))


def _common(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `sweep`: the workload, then the simulated deployment."""
    _workload_args(p)
    _deployment_args(p)


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        default="sharegpt",
        help="workload: sharegpt[:split=test], mixed[:long_share=0.35,...], "
        "multiturn[:turns=8,think=5] (--num-requests = conversations), "
        "sysprompt[:system=1024,systems=1], csv:PATH (Azure/BurstGPT), jsonl:PATH "
        "(default: sharegpt)",
    )
    p.add_argument("--num-requests", type=int, default=2000, help="requests per point")
    p.add_argument(
        "--arrival",
        choices=("poisson", "gamma", "uniform", "trace"),
        default=None,
        help="arrival process (default poisson; csv/jsonl: trace timestamps)",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    p.add_argument(
        "--slo",
        default="none",
        help="none | uniform:tbt=S[,ttft=S] | heterogeneous[:scales=a/b/..] (+ ,jct_share=F)",
    )


def _deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        default="a100-80g/llama-2-7b",
        help="roofline name or profile JSON from `alise executor profile`",
    )
    p.add_argument(
        "--prediction",
        default="oracle",
        help="oracle | mean[:value=N] | prior[:value=N] | noisy:sigma=S | file:PATH",
    )
    p.add_argument("--executors", type=int, default=1, help="executors behind the scheduler")
    p.add_argument("--device-blocks", type=int, default=None, help="KV blocks per executor")
    p.add_argument("--host-blocks", type=int, default=None, help="host swap blocks")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="default 4096 (mixed workload: 34816)"
    )
    p.add_argument("--swap-bandwidth-gbs", type=float, default=25.0)
    p.add_argument(
        "--no-overlap-swaps",
        action="store_true",
        help="add swap time to the step instead of overlapping it",
    )
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="the core's prefix cache (traces with segments: multiturn, sysprompt)",
    )
    p.add_argument(
        "--placement",
        choices=("cache", "load"),
        default="cache",
        help="several executors: cached prefix against load (cache), or load only",
    )
    p.add_argument(
        "--prefill-attention",
        default="off",
        help="add the O(n^2) prefill attention FLOPs the linear cost model omits: "
        "off | auto (from the roofline GPU/model) | seconds per token pair",
    )
    p.add_argument(
        "--clock",
        choices=("measured", "fit"),
        default="measured",
        help="step durations: the fitted cost model corrected by the profile's "
        "measured samples nearest in shape (measured; the fit alone for "
        "roofline profiles), or the fitted linear model alone (fit)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-iterations",
        type=int,
        default=None,
        help="give up on a point after this many steps (run: 5M; sweep: 400K); "
        "a sweep records it as a failed point",
    )


def _attention(text: str) -> float | None:
    if text == "off":
        return None
    if text == "auto":
        return -1.0
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"--prefill-attention: off, auto or a number, got {text!r}") from None


def _base_config(args, policy: str = "fcfs"):
    from lab.sim.config import SimConfig

    max_len = args.max_model_len or (34816 if args.trace.startswith("mixed") else 4096)
    return SimConfig(
        policy=policy,
        profile=args.profile,
        num_executors=args.executors,
        num_device_blocks=args.device_blocks,
        num_host_blocks=args.host_blocks,
        max_model_len=max_len,
        prediction=args.prediction,
        swap_bandwidth_gbs=args.swap_bandwidth_gbs,
        overlap_swaps=not args.no_overlap_swaps,
        prefix_caching=args.prefix_caching,
        cache_aware_placement=args.placement == "cache",
        seed=args.seed,
        prefill_attention_s=_attention(args.prefill_attention),
        clock=args.clock,
        max_iterations=args.max_iterations
        or (400_000 if args.sim_command == "sweep" else 5_000_000),
    )


def _trace_spec(args):
    from lab.sim.sweep import TraceSpec

    return TraceSpec(
        args.trace, args.num_requests, args.arrival, args.burstiness, args.slo, args.seed
    )


def _run(args) -> int:
    from dataclasses import asdict

    from lab.sim.config import prefill_attention_coeff
    from lab.sim.run import simulate
    from lab.sim.sweep import build_trace, cached_profile, policy_config

    config = policy_config(args.policy, _base_config(args))
    profile = cached_profile(config.profile)
    items = build_trace(
        _trace_spec(args), args.rate, profile, prefill_attention_coeff(config, profile)
    )
    result = simulate(items, config, profile)
    out = {"policy": args.policy, "rate": args.rate, **result.summary}
    emit_json(out, args.json)
    if args.records:
        with open(args.records, "w") as f:
            for r in result.records:
                f.write(json.dumps(asdict(r)) + "\n")
    if args.iterations:
        with open(args.iterations, "w") as f:
            for it in result.iterations:
                f.write(json.dumps(asdict(it)) + "\n")
    return 0


def _criteria(args, profile: dict):
    from lab.workload.capacity import Criterion, sarathi_tbt_slo
    from services.scheduler.core.cost_model import CostModel

    tbt = args.tbt_slo or sarathi_tbt_slo(
        CostModel.from_profile(profile).iteration_time, args.tbt_slo_factor
    )
    return [Criterion("normalized_latency", args.nl_bound), Criterion("p99_tbt", tbt)]


def _sweep(args) -> int:
    from lab.sim.sweep import cached_profile, sweep
    from lab.workload.plots import plot_results

    base = _base_config(args)
    criteria = _criteria(args, cached_profile(base.profile))
    cdf_rate = args.cdf_rate if args.cdf_rate is not None else args.rates[len(args.rates) // 2]
    results = sweep(
        args.policies,
        args.rates,
        base,
        _trace_spec(args),
        criteria,
        jobs=args.jobs,
        rel_tol=args.rel_tol,
        max_rounds=args.rounds,
        cdf_rate=cdf_rate if cdf_rate in args.rates else None,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plots = [] if args.no_plots else plot_results(results, out)
    print(
        json.dumps(
            {
                "capacity": results["capacity"],
                "wall_s": round(results["wall_s"], 1),
                "results": str(out / "results.json"),
                "plots": [str(p) for p in plots],
            },
            indent=2,
        )
    )
    return 0


def _fidelity(args) -> int:
    from dataclasses import replace

    from lab.sim.fidelity import check
    from lab.workload.traces.arrivals import poisson_arrivals
    from lab.workload.traces.trace import build_trace
    from lab.workload.traces.workloads import sample_shapes, sharegpt_pool
    from services.common.models import load_tokenizer
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

    settings = ExecutorSettings()
    pool = [
        replace(s, output_len=min(s.output_len, args.max_output))
        for s in sharegpt_pool("test", settings.model)
        if s.prompt_len <= args.max_prompt
    ]
    shapes = sample_shapes(pool, args.num_requests, args.seed)
    items = build_trace(shapes, poisson_arrivals(len(shapes), args.rate, args.seed))
    engine = Engine.from_settings(settings)
    try:
        if args.measure_profile:  # the same profiler, minutes before the run it predicts
            from services.executor.profiler import profile_engine, write_profile

            write_profile(
                profile_engine(engine, max_prefill=args.measure_max_prefill), args.profile
            )
        report = check(
            engine,
            items,
            args.policy,
            args.profile,
            load_tokenizer(settings.model, settings.data_dir),
        )
    finally:
        engine.close()
    report["rate"] = args.rate
    emit_json(report, args.json)
    return 0 if report["within_15pct"] else 1


def _ceiling(args) -> int:
    from lab.sim.ceiling import oracle_ceiling
    from lab.sim.config import prefill_attention_coeff
    from lab.sim.sweep import build_trace, cached_profile

    base = _base_config(args, "hybrid")
    profile = cached_profile(base.profile)
    items = build_trace(
        _trace_spec(args), args.rate, profile, prefill_attention_coeff(base, profile)
    )
    result = oracle_ceiling(items, base, profile)
    result.update(trace=args.trace, rate=args.rate, profile=base.profile)
    if not args.all:
        result.pop("tried")
    emit_json(result, args.json)
    return 0


def _report(args) -> int:
    from lab.sim.report import report

    results = json.loads(Path(args.results).read_text())
    print(report(results, args.metrics, args.baseline))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("sim", help="discrete-event simulator of the scheduling core")
    group.set_defaults(_parser=group)
    inner = group.add_subparsers(dest="sim_command", metavar="COMMAND")
    _register_run(inner)
    _register_sweep(inner)
    _register_fidelity(inner)
    _register_report(inner)
    _register_ceiling(inner)


def _register_ceiling(inner: argparse._SubParsersAction) -> None:
    ceil = inner.add_parser(
        "ceiling",
        help="the best hybrid configuration with oracle lengths on a trace (knobs incl. "
        "a concurrency limit) and its mean normalized latency: the ordering ceiling",
    )
    ceil.add_argument(
        "--rate", type=float, default=None, help="requests/s (jsonl/csv: their timestamps)"
    )
    ceil.add_argument("--json", help="also write the result here")
    ceil.add_argument("--all", action="store_true", help="list every configuration tried")
    _common(ceil)
    ceil.set_defaults(func=_ceiling)


def _register_run(inner: argparse._SubParsersAction) -> None:
    run = inner.add_parser("run", help="simulate one policy at one rate; print metrics JSON")
    run.add_argument("--policy", default="fcfs", help="name[:knob=value,...][@prediction]")
    run.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests/s (required unless the trace keeps its own timestamps)",
    )
    run.add_argument("--json", help="also write the metrics JSON here")
    run.add_argument("--records", help="write per-request records (JSONL)")
    run.add_argument("--iterations", help="write per-iteration records (JSONL)")
    _common(run)
    run.set_defaults(func=_run)


def _register_sweep(inner: argparse._SubParsersAction) -> None:
    sw = inner.add_parser("sweep", help="policies x rates, capacity search, results.json + plots")
    sw.add_argument(
        "--policies",
        nargs="+",
        required=True,
        help="entries `name[:knob=value,...][@prediction]`, space separated",
    )
    sw.add_argument("--rates", type=_rates, required=True, help="`2,4,8` or `2:16:2`")
    sw.add_argument("--out", required=True, help="output directory")
    sw.add_argument(
        "--nl-bound",
        type=float,
        default=0.2,
        help="capacity bound on mean normalized latency, s/token",
    )
    sw.add_argument(
        "--tbt-slo",
        type=float,
        default=None,
        help="P99 TBT SLO in s (default: --tbt-slo-factor x a 32x4K decode step)",
    )
    sw.add_argument(
        "--tbt-slo-factor", type=float, default=5.0, help="Sarathi-Serve: 5 strict, 25 relaxed"
    )
    sw.add_argument("--jobs", type=int, default=None, help="worker processes (default: cores)")
    sw.add_argument("--rel-tol", type=float, default=0.05, help="bisection stops at this width")
    sw.add_argument("--rounds", type=int, default=4, help="bisection rounds at most")
    sw.add_argument(
        "--cdf-rate",
        type=float,
        default=None,
        help="grid rate whose latency CDFs are kept (default: the middle one)",
    )
    sw.add_argument("--no-plots", action="store_true")
    _common(sw)
    sw.set_defaults(func=_sweep)


def _register_fidelity(inner: argparse._SubParsersAction) -> None:
    fid = inner.add_parser(
        "fidelity",
        help="simulator vs the real in-process executor on "
        "one ShareGPT trace (ALISE_EXECUTOR_* settings)",
    )
    fid.add_argument("--profile", required=True, help="JSON from `alise executor profile`")
    fid.add_argument(
        "--measure-profile",
        action="store_true",
        help="first profile this engine (as `alise executor profile`) and write "
        "the result to --profile: profile and run share the machine's state",
    )
    fid.add_argument(
        "--measure-max-prefill",
        type=int,
        default=512,
        help="with --measure-profile: leave out larger prefills (as --max-prefill)",
    )
    fid.add_argument("--policy", default="fcfs")
    fid.add_argument("--rate", type=float, default=2.0)
    fid.add_argument("--num-requests", type=int, default=100)
    fid.add_argument("--max-prompt", type=int, default=512)
    fid.add_argument("--max-output", type=int, default=64)
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--json", help="also write the report here")
    fid.set_defaults(func=_fidelity)


def _register_report(inner: argparse._SubParsersAction) -> None:
    rep = inner.add_parser("report", help="Markdown tables from a sweep's results.json")
    rep.add_argument("results", help="results.json of `alise sim sweep`")
    rep.add_argument(
        "--metrics",
        nargs="*",
        default=["mean_normalized_latency", "p99_tbt"],
        help="per-rate tables of these point metrics",
    )
    rep.add_argument("--baseline", default="fcfs", help="capacity ratios against this policy")
    rep.set_defaults(func=_report)


if __name__ == "__main__":
    from services.main import build_parser, run

    sys.exit(run(build_parser([register]), ["sim", *sys.argv[1:]]))
