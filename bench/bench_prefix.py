"""`alise bench prefix`: the prefix cache on and off, side by side, on multi-turn chats.

Replays ShareGPT conversations turn by turn (each turn's prompt is the history so far, with the
reference answers; traces/multiturn.py) through a freshly started stack (`alise serve`, the
bundled model) twice: `ALISE_PREFIX_CACHING=false`, then `true`, same trace, same seed. What
users send: EOS honoured, one `max_tokens` cap, greedy sampling, predictions from the real
predictor. Prints, per run, mean and p90 TTFT, mean normalized latency, the prefix-cache hit
rate (cached prompt tokens / prompt tokens, from each response's usage), and across the runs
the TTFT ratio and how many answers are token for token the same.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from lab.workload.report import emit_json

KEYS = ("mean_ttft", "p90_ttft", "mean_normalized_latency", "prefix_cache_hit_rate", "completed")


def trace(args: argparse.Namespace):
    from lab.workload.traces.multiturn import multiturn_trace, sharegpt_conversations

    convs = sharegpt_conversations(
        args.conversations, max_turns=args.turns, max_total=args.max_total
    )
    return multiturn_trace(convs, args.rate, args.think, args.seed)


def _replay(url: str, items, max_tokens: int):
    from dataclasses import replace

    from bench.live import run_trace, served_model

    model = asyncio.run(served_model(url))
    capped = [replace(i, output_len=max_tokens) for i in items]
    # greedy: both runs (cache on, off) get the same answers, so only the cache differs
    return asyncio.run(run_trace(url, capped, model, ignore_eos=False, temperature=0.0))


def _run(args: argparse.Namespace) -> int:
    from bench.bench_serve import LiveStack
    from lab.workload.metrics import summarize

    items = trace(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="alise-bench-prefix-"))
    out.mkdir(parents=True, exist_ok=True)
    runs, texts = {}, {}
    for name, caching in (("off", "false"), ("on", "true")):
        stack = LiveStack(
            args.policy, out, name=f"cache-{name}", env={"ALISE_PREFIX_CACHING": caching}
        )
        try:
            stack.wait_ready()
            results = _replay(stack.url, items, args.max_tokens)
        finally:
            stack.stop()
        summary = summarize([r.record for r in results])
        runs[name] = {k: summary.get(k) for k in KEYS} | {
            "errors": sum(r.error is not None for r in results)
        }
        texts[name] = [r.text for r in results]
    same = sum(a == b for a, b in zip(texts["off"], texts["on"], strict=True))
    result = {
        "runs": runs,
        "ttft_ratio_off_on": runs["off"]["mean_ttft"] / runs["on"]["mean_ttft"],
        "identical_outputs": same,
        "requests": len(items),
        "conversations": args.conversations,
        "rate": args.rate,
        "think_s": args.think,
        "max_tokens": args.max_tokens,
        "policy": args.policy,
        "ignore_eos": False,
        "temperature": 0.0,
    }
    emit_json(result, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prefix", help="prefix cache on vs off on multi-turn chats (live stack, side by side)"
    )
    p.add_argument("--conversations", type=int, default=50)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation at most")
    p.add_argument("--max-total", type=int, default=1600, help="history + answer tokens at most")
    p.add_argument("--rate", type=float, default=0.5, help="requests/s over all conversations")
    p.add_argument("--think", type=float, default=5.0, help="mean seconds between turns")
    p.add_argument("--max-tokens", type=int, default=64, help="the cap every request sends")
    p.add_argument("--policy", default="hybrid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="logs directory (default: a temporary one)")
    p.add_argument("--json", help="also write the figures here")
    p.set_defaults(func=_run)
