"""`alise executor serve | profile` (lab/executor/cli.py adds `stub`)."""

from __future__ import annotations

import argparse
import json


def _settings():
    from services.common.settings import ExecutorSettings

    return ExecutorSettings()


def _serve(args: argparse.Namespace) -> int:
    """Serve until a signal; exit 1 when loading or warm-up fails (the reason is logged on
    one line by the server)."""
    from services.common.logs import setup_logging
    from services.common.runner import run_until_signal
    from services.executor.server import StartupFailed, start_executor

    settings = _settings()
    setup_logging("executor", settings.log_level, settings.log_format)
    try:
        return run_until_signal(
            lambda: start_executor(settings),
            lambda handle: f"executor listening on {settings.executor_host}:{handle.port}",
        )
    except StartupFailed:
        return 1


def _profile(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.executor.engine import Engine
    from services.executor.profiler import profile_engine, summary, write_profile

    settings = _settings()
    setup_logging("executor", settings.log_level, settings.log_format)
    engine = Engine.from_settings(settings)
    engine.warm_up()  # CUDA: time the steps as served (kernels compiled, graphs captured)
    profile = profile_engine(engine, quick=args.quick, max_prefill=args.max_prefill)
    engine.close()
    write_profile(profile, args.out)
    print(json.dumps(summary(profile)))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("executor", help="model executor service")
    inner = group.add_subparsers(dest="executor_command", metavar="COMMAND")
    group.set_defaults(_parser=group, _commands=inner)  # lab/executor/cli.py adds `stub`
    serve = inner.add_parser("serve", help="serve the Executor gRPC API (ALISE_* settings)")
    serve.set_defaults(func=_serve)
    profile = inner.add_parser(
        "profile", help="time a grid of batches and fit the iteration-time cost model"
    )
    profile.add_argument("--out", required=True, help="profile JSON to write")
    profile.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    profile.add_argument(
        "--max-prefill",
        type=int,
        default=None,
        help="leave out batches with more prefill tokens than this",
    )
    profile.set_defaults(func=_profile)
