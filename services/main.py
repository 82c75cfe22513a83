"""The serving commands: `python -m services <command>` (what `alise serve` spawns for each
service, and what the images run under the `alise` name).

Each command group lives beside the code it drives, in a module with a
`register(subparsers)` function that adds its parser and sets `func` (a callable taking the
parsed args). Heavy imports (torch, transformers) stay inside those functions so that
`--help` is instant. The `alise` command (the top-level `cli` package) adds the lab's and the
benchmarks' groups to these; nothing here names them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable

from services.executor import cli as executor_cli
from services.gateway import cli as gateway_cli
from services.launcher import admin_cli
from services.launcher import cli as launcher_cli
from services.predictor import cli as predictor_cli
from services.scheduler import cli as scheduler_cli

Register = Callable[[argparse._SubParsersAction], None]

# in the order `--help` lists them; the admin group (health, proto, config) goes last
SERVICE_GROUPS: tuple[Register, ...] = (
    launcher_cli.register,  # serve
    gateway_cli.register,  # gateway ...
    scheduler_cli.register,  # scheduler ...
    executor_cli.register,  # executor ...
    predictor_cli.register,  # predictor ...
)
ADMIN_GROUPS: tuple[Register, ...] = (admin_cli.register,)  # health, proto, config


def build_parser(
    groups: Iterable[Register] = (), extensions: Iterable[Register] = ()
) -> argparse.ArgumentParser:
    """The parser of the serving commands, with `groups` listed between the services' and
    the admin commands and `extensions` then adding subcommands to existing groups."""
    parser = argparse.ArgumentParser(
        prog="alise",
        description="ALISE: speculative, SLO-aware LLM serving (gateway, predictor, "
        "scheduler, executors).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in (*SERVICE_GROUPS, *groups, *ADMIN_GROUPS, *extensions):
        register(subparsers)
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


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen command (a group alone prints its help)."""
    _die_with_parent()
    _apply_nice()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        target = getattr(args, "_parser", parser)
        target.print_help()
        return 0 if args.command is None else 2
    return int(func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)
