"""`alise bench <name>`: each benchmark is a module `bench/bench_<name>.py` with
`register(subparsers)`; this group lists whichever exist. Every benchmark prints JSON figures
and writes them to `--json FILE`.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import bench


def command_line(name: str) -> str:
    """`alise bench NAME ...` as this process was called (just the name when called in-process,
    e.g. from a test)."""
    import sys

    args = sys.argv[sys.argv.index(name) + 1 :] if name in sys.argv else []
    return " ".join(["alise bench", name, *args])


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("bench", help="benchmarks that print JSON figures")
    group.set_defaults(_parser=group)
    inner = group.add_subparsers(dest="bench", metavar="BENCHMARK")
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if info.name.startswith("bench_"):
            importlib.import_module(f"bench.{info.name}").register(inner)
