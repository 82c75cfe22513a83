"""`alise scheduler serve`: run the scheduler service until SIGINT/SIGTERM (ALISE_* settings)."""

from __future__ import annotations

import argparse


def _serve(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.common.runner import run_until_signal
    from services.common.settings import SchedulerSettings
    from services.scheduler.server import start_scheduler

    overrides = {
        k: v for k, v in (("policy", args.policy), ("scheduler_port", args.port)) if v is not None
    }
    if args.executors:
        overrides["executors"] = args.executors.split(",")
    settings = SchedulerSettings(**overrides)
    setup_logging("scheduler", settings.log_level, settings.log_format)

    return run_until_signal(
        lambda: start_scheduler(settings),
        lambda handle: (
            f"scheduler listening on {settings.scheduler_host}:{handle.port} "
            f"(policy {settings.policy}, executors {','.join(settings.executors)})"
        ),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("scheduler", help="the scheduler service")
    group.set_defaults(_parser=group)
    inner = group.add_subparsers(dest="scheduler_command", metavar="COMMAND")
    serve = inner.add_parser("serve", help="serve the Scheduler gRPC API (ALISE_* settings)")
    serve.add_argument("--policy", help="scheduling policy (default: ALISE_POLICY)")
    serve.add_argument("--port", type=int, help="gRPC port (default: ALISE_SCHEDULER_PORT)")
    serve.add_argument("--executors", help="comma-separated executor addresses")
    serve.set_defaults(func=_serve)
