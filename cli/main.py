"""`alise`: services/main.py's parser plus the lab's and the benchmarks' command groups.

The lab and bench packages are optional (an image may leave them out): a group whose module
is not installed is simply not listed."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from services import main as services_main

# groups listed after the services' own (`register`), then additions to a service's group
# (`extend`): evaluation, calibration and the stub executor
GROUPS = ("lab.sim.cli", "bench.cli")  # alise sim ..., alise bench ...
EXTENSIONS = ("lab.predictor.cli", "lab.executor.cli")


def _available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _loaded(names: tuple[str, ...], attr: str) -> list[services_main.Register]:
    return [getattr(importlib.import_module(n), attr) for n in names if _available(n)]


def build_parser() -> argparse.ArgumentParser:
    return services_main.build_parser(_loaded(GROUPS, "register"), _loaded(EXTENSIONS, "extend"))


def main(argv: list[str] | None = None) -> int:
    return services_main.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
