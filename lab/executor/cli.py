"""The executor group's lab command: `alise executor stub` (benchmark stub executors), added
to the group services/executor/cli.py registers."""

from __future__ import annotations

import argparse


def _stub(args: argparse.Namespace) -> int:
    from lab.executor.stub import serve_stubs
    from services.common.logs import setup_logging
    from services.common.runner import run_until_signal
    from services.common.settings import ExecutorSettings

    settings = ExecutorSettings()
    setup_logging("executor", settings.log_level, settings.log_format)
    return run_until_signal(
        lambda: serve_stubs(
            args.count,
            args.step_ms / 1000,
            settings.executor_host,
            settings.registry_url,
            settings.redis_namespace,
        ),
        lambda fleet: (
            "stub executors listening on " + ",".join(fleet.addresses(settings.executor_host))
        ),
    )


def extend(subparsers: argparse._SubParsersAction) -> None:
    """Add `stub` to the `executor` group (registered before this is called)."""
    group = subparsers.choices.get("executor")
    if group is None:
        return
    inner = group.get_default("_commands")
    stub = inner.add_parser(
        "stub",
        help="benchmark stubs: N executors with the real Step contract, no model, a fixed "
        "step time (registered in Redis with ALISE_REGISTRY_URL)",
    )
    stub.add_argument("--count", type=int, default=8, help="stub executors to serve")
    stub.add_argument("--step-ms", type=float, default=25.0, help="time of every Step")
    stub.set_defaults(func=_stub)
