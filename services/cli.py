"""The `alise` command.

Each command group lives beside the code it drives, in a module with a
`register(subparsers)` function that adds its parser and sets `func` (a callable taking the
parsed args). Heavy imports (torch, transformers) stay inside those functions so that
`alise --help` is instant. A group whose module is not installed (an image without lab/ or
bench/) is simply not listed; the modules are named here, not imported, so serving code does
not depend on them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# (module, registers) in the order `alise --help` lists them.
COMMAND_MODULES = (
    "services.launcher.cli",  # alise serve
    "services.gateway.cli",  # alise gateway ...
    "services.scheduler.cli",  # alise scheduler ...
    "services.executor.cli",  # alise executor ...
    "services.predictor.cli",  # alise predictor ...
    "lab.scheduler.sim_cli",  # alise sim ...
    "bench.cli",  # alise bench ...
    "services.launcher.admin_cli",  # alise health, proto, config
)
# Lab commands that join a service's group above (`extend(subparsers)`): evaluation,
# calibration and benchmark stubs live in lab/, which serving code never imports.
EXTENDING_MODULES = (
    "lab.predictor.cli",  # alise predictor train --proxy | calibrate | eval | bench-store
    "lab.executor.cli",  # alise executor stub
)


def _available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alise",
        description="ALISE: speculative, SLO-aware LLM serving (gateway, predictor, "
        "scheduler, executors).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        if _available(name):
            importlib.import_module(name).register(subparsers)
    for name in EXTENDING_MODULES:
        if _available(name):
            importlib.import_module(name).extend(subparsers)
    return parser


def _apply_nice() -> None:
    """Under `alise serve`: the control plane's lower priority (launcher/cpu_plan.py)."""
    nice = int(os.environ.get("ALISE_NICE", "0") or 0)
    if nice > 0:
        os.nice(nice)


def _die_with_parent() -> None:
    """Under `alise serve`: get SIGTERM when the launcher dies, even by SIGKILL."""
    parent = os.environ.pop("ALISE_DIE_WITH_PARENT", "")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # the launcher died before we asked
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    _apply_nice()
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # A group given without a subcommand: print that group's help.
        target = getattr(args, "_parser", parser)
        target.print_help()
        return 0 if args.command is None else 2
    result = func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
