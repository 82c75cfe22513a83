import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["services.common", "services.gateway", "services.predictor",
                                    "services.scheduler", "services.executor", "bench"])
def test_packages_import(module):
    assert importlib.import_module(module).__doc__


def test_alise_help_lists_existing_commands():
    alise = Path(sys.executable).parent / "alise"
    assert alise.exists(), "the `alise` console script is not installed"
    out = subprocess.run([str(alise), "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "proto", "config"):
        assert command in out


def test_config_markdown_lists_settings():
    from services.cli import main
    import contextlib, io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["config", "--markdown"]) == 0
    assert "`ALISE_REDIS_URL`" in buf.getvalue()
