import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    [
        "services.common",
        "services.gateway",
        "services.predictor",
        "services.scheduler",
        "services.executor",
        "lab",
        "bench",
    ],
)
def test_packages_import(module):
    assert importlib.import_module(module).__doc__


def test_alise_help_lists_existing_commands():
    alise = Path(sys.executable).parent / "alise"
    assert alise.exists(), "the `alise` console script is not installed"
    out = subprocess.run([str(alise), "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "proto", "config"):
        assert command in out


def test_building_the_command_line_imports_no_model_library():
    """Every `alise serve` process (Redis's runner, the scheduler, the gateway) parses its
    command first: a lab command whose module imported torch at the top cost each of them
    ~170 MiB and a second (the soak saw the scheduler at 265 MiB instead of 87)."""
    code = (
        "import sys; from cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'sentence_transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_lab_commands_join_the_service_groups():
    """`alise predictor calibrate | eval | bench-store | train --proxy` and `alise executor
    stub` live in lab/ (serving never imports it) yet keep their names."""
    from cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["predictor", "train", "--proxy", "--limit", "5"])
    assert args.proxy and args.limit == 5 and callable(args.func)
    assert not parser.parse_args(["predictor", "train"]).proxy
    for argv in (
        ["predictor", "calibrate", "--n", "3"],
        ["predictor", "eval", "--no-proxy"],
        ["predictor", "bench-store"],
        ["executor", "stub", "--count", "2"],
        ["sim", "run", "--policy", "fcfs"],
    ):
        assert callable(parser.parse_args(argv).func), argv
    assert parser.parse_args(["predictor", "calibrate"]).func.__module__ == "lab.predictor.cli"
    assert parser.parse_args(["executor", "stub"]).func.__module__ == "lab.executor.cli"


def test_config_markdown_lists_settings():
    import contextlib
    import io

    from cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["config", "--markdown"]) == 0
    assert "`ALISE_REDIS_URL`" in buf.getvalue()


def test_config_policies_prints_each_policy_knobs_as_json():
    import contextlib
    import io
    import json

    from cli.main import main
    from services.scheduler.core.policies import available_policies, policy_knobs

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["config", "--policies"]) == 0
    lines = dict(line.split(" ", 1) for line in buf.getvalue().splitlines())
    assert sorted(lines) == sorted(available_policies())
    for name, knobs in lines.items():
        assert json.loads(knobs) == policy_knobs(name)


def test_readme_policy_knob_defaults_match_the_code():
    """Every `policy `knob=value`` pair in the README's knob table is the code's default."""
    import re

    from services.scheduler.core.policies import policy_knobs

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("### Policy knobs", 1)[1].split("\n## ", 1)[0]
    pairs = re.findall(r"(\w+) `(\w+)=([^`]+)`", table)
    assert len(pairs) >= 25, pairs
    for policy, knob, value in pairs:
        assert knob in policy_knobs(policy), (policy, knob)
        assert str(policy_knobs(policy)[knob]) == value, (policy, knob, value)


def test_the_serving_commands_stand_without_the_lab():
    """`python -m services` (what `alise serve` spawns) lists the services' groups and none of
    the lab's or the benchmarks', and loads no module of theirs."""
    code = (
        "import sys; from services.main import build_parser; build_parser().print_help(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lab', 'bench', 'cli'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    help_text, loaded = out.stdout.rsplit("\n", 2)[0], out.stdout.strip().splitlines()[-1]
    assert loaded == "[]"
    for command in ("serve", "gateway", "scheduler", "executor", "predictor", "health"):
        assert command in help_text
    assert "bench" not in help_text.split("positional arguments", 1)[1].split("options", 1)[0]
