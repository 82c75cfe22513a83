"""The predictor group's lab commands: `alise predictor train --proxy | calibrate | eval
[--target served] | state-ceiling | bench-store`, added to the group services/predictor/cli.py registers."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings


def _settings() -> PredictorSettings:
    from services.common.settings import PredictorSettings

    return PredictorSettings()


def _train_proxy(args: argparse.Namespace) -> int:
    import logging

    from lab.predictor.proxy import train_proxy

    logging.basicConfig(level=logging.INFO)
    report = train_proxy(_settings(), limit=args.limit or 2000, epochs=args.epochs or 1)
    print(json.dumps(report))
    return 0


def _with_proxy(train: argparse.ArgumentParser) -> None:
    """`train --proxy`: the proxy baseline (eval only) instead of the serving MLP."""
    train.add_argument(
        "--proxy",
        action="store_true",
        help="fine-tune the embedder end-to-end with a regression head",
    )
    mlp: Callable[[argparse.Namespace], int] = train.get_default("func")
    train.set_defaults(func=lambda args: _train_proxy(args) if args.proxy else mlp(args))


def _calibrate(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from lab.predictor.calibrate import calibrate

    logging.basicConfig(level=logging.INFO)
    report = calibrate(
        _settings(),
        args.n,
        args.max_tokens,
        Path(args.out) if args.out else None,
        batch=args.batch,
        temperature=args.temperature,
        threads=args.threads,
        split=args.split,
        seed=args.seed,
        draws=args.draws,
        predict_every=args.predict_every,
    )
    print(json.dumps(report))
    return 0


def _train_probe(args: argparse.Namespace) -> int:
    import logging

    from lab.predictor.probe_train import main

    logging.basicConfig(level=logging.INFO)
    return main(args)


def _add_train_probe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tp = sub.add_parser(
        "train-probe",
        help="fit the executor's remaining-length probe on a calibration file's features",
    )
    tp.add_argument("--cap", type=int, default=256, help="the calibration cap")
    tp.add_argument(
        "--regime", choices=("t0", "t1", "both"), default="both", help="temperature regime"
    )
    tp.add_argument("--hidden", type=int, default=64, help="hidden units (0: linear)")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--out-dir", help="probes root (default: services/executor/probes)")
    tp.set_defaults(func=_train_probe)


def _eval(args: argparse.Namespace) -> int:
    from lab.predictor.evaluate import main

    return main(args)


def _bench_store(args: argparse.Namespace) -> int:
    from lab.predictor.bench_store import main

    return main(args)


def _add_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cal = sub.add_parser(
        "calibrate",
        help="the served model's own lengths for N train-split prompts (resumable JSONL)",
    )
    cal.add_argument("--n", type=int, default=2000, help="prompts the file should hold")
    cal.add_argument("--max-tokens", type=int, default=256, help="the cap (as a client sends)")
    cal.add_argument(
        "--out",
        help="JSONL file (default: DATA_DIR/calibration/MODEL-capN-t0|t1[-test].jsonl); appended",
    )
    cal.add_argument(
        "--batch", type=int, default=32, help="sequences decoded together (prompts x draws)"
    )
    cal.add_argument(
        "--draws", type=int, default=0, help="answers per prompt (0: 4 at temperature > 0, 1 at 0)"
    )
    cal.add_argument(
        "--predict-every",
        type=int,
        default=16,
        help="record the probe's features at each prefill and every N output tokens (0 = off)",
    )
    cal.add_argument("--temperature", type=float, default=1.0, help="the API's default: 1.0")
    cal.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    cal.add_argument(
        "--seed", type=int, default=0, help="sampling seed (another seed: another answer)"
    )
    cal.add_argument(
        "--split",
        default="train",
        choices=("train", "test"),
        help="train seeds the predictor; test is held out to score it",
    )
    cal.set_defaults(func=_calibrate)


def _add_eval(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from lab.predictor.served_eval import add_arguments as served_eval_arguments

    ev = sub.add_parser("eval", help="prior / mlp / retrieval / ours / proxy on the test split")
    ev.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ev.add_argument(
        "--target",
        choices=("reference", "served"),
        default="reference",
        help="score against ShareGPT's reference lengths, or the served model's own "
        "(held-out calibrated prompts; the options below)",
    )
    served_eval_arguments(ev)
    ev.add_argument(
        "--text",
        choices=("norm", "chat"),
        default="norm",
        help="embed the user text (norm) or the whole chat-formatted prompt",
    )
    ev.add_argument("--limit-test", type=int, default=None, help="first N test samples")
    ev.add_argument("--limit-train", type=int, default=None, help="first N train samples")
    ev.add_argument(
        "--latency-samples", type=int, default=200, help="prompts timed one by one per method"
    )
    ev.add_argument("--batches", type=int, default=10, help="batches of 32 timed per method")
    ev.add_argument("--no-proxy", action="store_true", help="leave the proxy out")
    ev.add_argument(
        "--write-predictions",
        metavar="PATH",
        help="also write ours' prediction per test prompt ({id: length}) for `alise sim "
        "--prediction file:PATH`",
    )
    ev.add_argument(
        "--tune",
        action="store_true",
        help="also sweep k and s0 on a validation part of the train split",
    )
    ev.set_defaults(func=_eval)


def extend(subparsers: argparse._SubParsersAction) -> None:
    """Add the lab commands to the `predictor` group (registered before this is called)."""
    from lab.predictor import state_ceiling

    group = subparsers.choices.get("predictor")
    if group is None:
        return
    sub = group.get_default("_commands")
    _with_proxy(sub.choices["train"])
    _add_calibrate(sub)
    _add_eval(sub)
    _add_train_probe(sub)
    state_ceiling.add_parser(sub)

    bench = sub.add_parser("bench-store", help="qdrant-client local mode vs Qdrant Edge")
    bench.add_argument("--points", type=int, default=16_000)
    bench.add_argument("--queries", type=int, default=300)
    bench.add_argument("-k", type=int, default=8)
    bench.add_argument("--vectors", default=None, help=".npz with a `vectors` array")
    bench.set_defaults(func=_bench_store)
