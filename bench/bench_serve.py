"""`alise bench serve`: load against a running gateway over HTTP SSE (vllm bench serve
conventions), and `alise bench sweep --live`: the same across policies and rates, each
policy on a freshly started stack, with the simulator sweep's results.json schema and plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lab.workload.metrics import summarize
from lab.workload.report import emit_json

LIVE_POLICIES = ("fcfs", "sarathi", "alise", "accelgen", "hybrid")


def live_trace(
    workload: str,
    n: int,
    rate: float,
    arrival: str,
    burstiness: float,
    slo: str | None,
    seed: int,
    max_prompt: int,
    max_output: int,
    mode: str = "fixed",
    offset: int = 0,
):
    """The trace with prompts <= max_prompt tokens; each item's `output_len` is the
    `max_tokens` it sends: `max_output` for every request (mode `fixed`, what a client
    sends), or its reference length capped at `max_output` (mode `reference`, the papers'
    replay, sent with ignore_eos). `offset`: the n requests after the first `offset` (other
    prompts, the same arrival process)."""
    from dataclasses import replace

    from lab.workload.traces.spec import make_trace

    items = make_trace(workload, None, rate, arrival, burstiness, slo, seed)
    items = [i for i in items if i.prompt and i.prompt_len <= max_prompt][offset : offset + n]
    if len(items) < n:
        raise ValueError(
            f"only {offset + len(items)} requests with text and prompt <= {max_prompt}"
        )
    first = items[0].arrival_s
    # Re-draw arrivals for exactly these n requests so the rate is the one asked for.
    from lab.workload.traces.arrivals import make_arrivals

    times = (
        make_arrivals(n, arrival, rate, burstiness, seed)
        if arrival != "trace"
        else [i.arrival_s - first for i in items]
    )
    return [
        replace(
            i,
            arrival_s=t,
            output_len=max_output if mode == "fixed" else min(i.output_len, max_output),
        )
        for i, t in zip(items, times)
    ]


def request_details(results) -> list[dict]:
    """Per-request figures (`--save-detailed`, as vllm bench serve): what the client saw, by
    the shared metric definitions."""
    from lab.workload import metrics

    def rounded(value):
        return None if value is None else round(value, 4)

    rows = []
    for item in results:
        r = item.record
        gaps = metrics.tbts(r)
        rows.append(
            {
                "request_id": r.request_id,
                "arrival_s": round(r.arrival_s, 4),
                "prompt_len": r.prompt_len,
                "cached_tokens": r.cached_tokens,
                "output_len": r.output_len,
                "ttft_s": rounded(metrics.ttft(r)),
                "e2e_s": rounded(metrics.e2e(r)),
                "normalized_latency": rounded(metrics.normalized_latency(r)),
                "max_tbt_s": rounded(max(gaps)) if gaps else None,
                "error": item.error,
            }
        )
    return rows


def run_point(
    url: str,
    items,
    ignore_eos: bool,
    max_concurrency: int | None,
    detailed: bool = False,
    temperature: float = 1.0,
    sample_seed: int | None = None,
) -> dict:
    """One trace against the gateway at `url`: the summary (plus `temperature`, and each
    request's figures when `detailed`)."""
    from tqdm import tqdm

    from bench.live import run_trace, served_model

    model = asyncio.run(served_model(url))
    with tqdm(total=len(items), desc="requests", leave=False) as bar:
        results = asyncio.run(
            run_trace(
                url, items, model, ignore_eos, max_concurrency, bar,
                temperature=temperature, sample_seed=sample_seed,
            )
        )  # fmt: skip
    summary = summarize([r.record for r in results])
    summary["temperature"] = temperature
    summary["sample_seed"] = sample_seed
    summary["errors"] = [r.error for r in results if r.error][:5]
    summary["num_errors"] = sum(1 for r in results if r.error)
    if detailed:
        summary["requests"] = request_details(results)
    return summary


def ignores_eos(args: argparse.Namespace) -> bool:
    """EOS is honoured in `fixed` mode; the `reference` replay ignores it (unless told not)."""
    return args.max_tokens_mode == "reference" and not args.no_ignore_eos


def trace_for(args: argparse.Namespace, rate: float, offset: int = 0):
    return live_trace(
        args.dataset,
        args.num_prompts,
        rate,
        args.arrival,
        args.burstiness,
        args.slo,
        args.seed,
        args.max_prompt,
        args.max_tokens,
        args.max_tokens_mode,
        offset,
    )


def _replay(args: argparse.Namespace, url: str, rate: float) -> dict:
    """One point: the command line's trace at `rate`, sent to the gateway at `url`."""
    return run_point(
        url,
        trace_for(args, rate),
        ignores_eos(args),
        args.max_concurrency,
        args.save_detailed,
        args.temperature,
        args.sample_seed,
    )


def _serve_cmd(args: argparse.Namespace) -> int:
    summary = _replay(args, args.url, args.request_rate)
    summary.update(
        rate=args.request_rate,
        dataset=args.dataset,
        max_tokens_mode=args.max_tokens_mode,
        max_tokens=args.max_tokens,
        ignore_eos=ignores_eos(args),
    )
    emit_json(summary, args.json)
    return 0 if summary["num_errors"] == 0 else 1


class LiveStack:
    """`alise serve --policy P` on free ports, for one policy of a live sweep."""

    def __init__(
        self,
        policy: str,
        log_dir: Path,
        policy_config: str = "{}",
        step_trace: bool = False,
        name: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        from services.common.redis_runner import free_port

        self.port = free_port()
        self.policy = policy
        name = name or policy  # names the log file and the run directory
        self.log = open(log_dir / f"serve-{name}.log", "w")
        env = {
            **os.environ,
            "ALISE_GATEWAY_PORT": str(self.port),
            "ALISE_RUN_DIR": str(log_dir / f"run-{name}"),
            "PYTHONUNBUFFERED": "1",
            "ALISE_POLICY_CONFIG": policy_config,
            **(env or {}),
        }
        if step_trace:
            env["ALISE_STEP_TRACE"] = str(log_dir / f"run-{name}" / "steps.jsonl")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services", "serve", "--policy", policy],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = log_dir / f"serve-{name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"alise serve exited; see {self.log_path}")
            if "ALISE is ready" in self.log_path.read_text():
                return
            time.sleep(1)
        raise TimeoutError(f"alise serve not ready after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def policy_configs(specs: list[str] | None) -> dict[str, str]:
    """`POLICY=JSON` options -> {policy: JSON knobs} (checked to be a JSON object)."""
    configs = {}
    for spec in specs or []:
        policy, sep, text = spec.partition("=")
        try:
            knobs = json.loads(text) if sep else None
        except json.JSONDecodeError:
            knobs = None
        if not policy or not isinstance(knobs, dict):
            raise SystemExit(f"--policy-config {spec!r}: expected POLICY='{{\"knob\": value}}'")
        configs[policy] = json.dumps(knobs)
    return configs


def _sweep_cmd(args: argparse.Namespace) -> int:
    if not args.live:
        print("the simulated sweep is `alise sim sweep`; pass --live to sweep the real stack")
        return 2
    from lab.workload.plots import plot_results

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points, configs = [], policy_configs(args.policy_config)
    for policy in args.policies.split(","):
        stack = LiveStack(policy, out, configs.get(policy, "{}"), args.save_detailed)
        try:
            stack.wait_ready()
            for rate in [float(r) for r in args.rates.split(",")]:
                summary = _replay(args, stack.url, rate)
                points.append(
                    {"policy": policy, "rate": rate, "max_tokens_mode": args.max_tokens_mode,
                     **summary}
                )  # fmt: skip
                print(
                    json.dumps(
                        {
                            k: points[-1].get(k)
                            for k in (
                                "policy",
                                "rate",
                                "temperature",
                                "mean_normalized_latency",
                                "p99_tbt",
                                "median_ttft",
                                "num_errors",
                            )
                        }
                    ),
                    flush=True,
                )
        finally:
            stack.stop()
    results = {
        "points": points,
        "capacity": {},
        "live": True,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plot_results(results, out)
    print(f"wrote {out / 'results.json'} and plots")
    return 0


def _trace_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        default="sharegpt:split=test",
        help="workload spec: sharegpt[:split=test], mixed, csv:PATH, jsonl:PATH",
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--arrival", default="poisson", help="poisson | gamma | uniform | trace")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--slo", default=None, help="SLO scheme spec (none, uniform:tbt=..)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt", type=int, default=512, help="drop longer prompts")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="the max_tokens every request sends (fixed mode); the cap on the reference "
        "lengths (reference mode)",
    )
    parser.add_argument(
        "--max-tokens-mode",
        choices=("fixed", "reference"),
        default="fixed",
        help="fixed: one max_tokens for every request, EOS honoured (what users send); "
        "reference: max_tokens = the reference answer length with ignore_eos (the papers' "
        "replay; an ablation: it tells the scheduler every length)",
    )
    parser.add_argument(
        "--no-ignore-eos", action="store_true", help="reference mode: honour EOS all the same"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature every request sends: the API default 1.0 (what users "
        "send); 0 = greedy, a second, labelled run",
    )
    parser.add_argument(
        "--sample-seed",
        type=int,
        default=None,
        help="send request i the seed SEED*1000003+i, so every policy gets the same draws "
        "(default: unseeded, as users send)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="also record every request's TTFT, E2E, normalized latency and "
        "longest gap in the JSON (key `requests`); a live sweep also "
        "writes each scheduler's step trace (run-POLICY/steps.jsonl)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="load a running gateway over HTTP SSE")
    serve.add_argument("--url", default="http://127.0.0.1:8000")
    serve.add_argument("--request-rate", type=float, default=1.0)
    serve.add_argument("--json", default=None)
    _trace_args(serve)
    serve.set_defaults(func=_serve_cmd)
    sweep = subparsers.add_parser("sweep", help="policies x rates on the live stack (--live)")
    sweep.add_argument("--live", action="store_true", help="start the real stack per policy")
    sweep.add_argument("--policies", default=",".join(LIVE_POLICIES))
    sweep.add_argument("--rates", default="0.5,2")
    sweep.add_argument("--out", default="results/live")
    sweep.add_argument(
        "--policy-config",
        action="append",
        metavar="POLICY=JSON",
        help="knobs for one policy's scheduler (repeatable), e.g. hybrid='{\"token_budget\": 128}'",
    )
    _trace_args(sweep)
    sweep.set_defaults(func=_sweep_cmd)
