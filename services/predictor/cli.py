"""`alise predictor serve | seed | train`: the serving commands (lab/predictor/cli.py adds
`train --proxy`, `calibrate`, `eval` and `bench-store` to the group)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings


def _settings() -> PredictorSettings:
    from services.common.settings import PredictorSettings

    return PredictorSettings()


def _serve(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.common.runner import run_until_signal
    from services.predictor.server import start_predictor

    settings = _settings()
    setup_logging("predictor", settings.log_level, settings.log_format)
    return run_until_signal(
        lambda: start_predictor(settings),
        lambda handle: f"predictor listening on {settings.predictor_host}:{handle.port}",
    )


def _seed(args: argparse.Namespace) -> int:
    import logging

    from services.predictor.build import build_predictor, seed, served_models

    logging.basicConfig(level=logging.INFO)
    settings = _settings()
    predictor = build_predictor(settings)
    model = served_models(settings)[0]
    if args.force or predictor.store.count(model) == 0:
        report = seed(settings, predictor, model, limit=args.limit)
    else:
        report = {
            "skipped": "store not empty (use --force)",
            "store_size": predictor.store.count(model),
        }
    predictor.store.close()
    print(json.dumps(report))
    return 0


def _train(args: argparse.Namespace) -> int:
    import logging

    from services.predictor.build import make_embedder, served_models, train_mlp

    logging.basicConfig(level=logging.INFO)
    settings = _settings()
    model = served_models(settings)[0]
    mlp, path = train_mlp(
        settings, make_embedder(settings), model, limit=args.limit, epochs=args.epochs or 60
    )
    print(json.dumps({"path": str(path), "prior": mlp.cfg.prior}))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("predictor", help="output-length predictor service")
    sub = group.add_subparsers(dest="predictor_command", metavar="SUBCOMMAND")
    group.set_defaults(_parser=group, _commands=sub)  # lab/predictor/cli.py adds its own

    serve = sub.add_parser("serve", help="run the gRPC predictor service")
    serve.set_defaults(func=_serve)

    seed = sub.add_parser("seed", help="bulk-load the ShareGPT train split into the store")
    seed.add_argument("--limit", type=int, default=None, help="first N train samples only")
    seed.add_argument("--force", action="store_true", help="seed even if the store has points")
    seed.set_defaults(func=_seed)

    train = sub.add_parser("train", help="train the MLP fallback (or --proxy, eval only)")
    train.add_argument(
        "--limit", type=int, default=None, help="train samples used (proxy default 2000)"
    )
    train.add_argument("--epochs", type=int, default=None, help="MLP 60 (early stop), proxy 1")
    train.set_defaults(func=_train)
