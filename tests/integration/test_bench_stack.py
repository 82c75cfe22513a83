"""`alise bench stack --device`: the device mode's command line and environments, and one run
on the CPU (a tiny random-weight model, one rate): the engine alone and the served stack
measured alike, the JSON file holding every figure the GPU run reports."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import bench_stack
from bench.bench_stack import device_envs, parse_env, parse_rates, prediction_source, prompt_offset


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_stack.register(parser.add_subparsers())
    return parser.parse_args(["stack", *argv])


def test_rates_and_extra_env_parse():
    assert parse_rates("64, 4", 8.0) == [4.0, 64.0]  # ascending: the last saturates
    assert parse_rates(None, 8.0) == [8.0]
    with pytest.raises(SystemExit):
        parse_rates("0,4", 8.0)
    assert parse_env("A=1, B=x=y") == {"A": "1", "B": "x=y"}
    assert parse_env(None) == {}
    with pytest.raises(SystemExit):
        parse_env("NOVALUE")


def test_each_rate_has_its_own_prompts_the_first_the_engine_alones():
    assert [prompt_offset(i, 100) for i in range(3)] == [0, 100, 200]


def test_device_envs_give_each_process_its_memory_share():
    args = _args(
        "--device", "cuda", "--model", "/m", "--load-format", "dummy",
        "--extra-env", "ALISE_CUDA_GRAPH_MAX_BATCH=256",
    )  # fmt: skip
    engine, stack = device_envs(args)
    common = {"ALISE_DEVICE": "cuda", "ALISE_MODEL": "/m", "ALISE_LOAD_FORMAT": "dummy",
              "ALISE_CUDA_GRAPH_MAX_BATCH": "256"}  # fmt: skip
    assert engine == common | {"ALISE_GPU_MEMORY_UTILIZATION": "0.35"}
    assert stack == common | {
        "ALISE_GPU_MEMORY_UTILIZATION": "0.5",
        "ALISE_NUM_EXECUTORS": "1",
        "ALISE_EMBEDDER": "none",
    }
    assert prediction_source(stack) == "prior-only predictor (ALISE_EMBEDDER=none)"
    # on a CPU no GPU share; --extra-env overrides the defaults
    engine, stack = device_envs(_args("--device", "cpu", "--extra-env", "ALISE_EMBEDDER=x"))
    assert "ALISE_GPU_MEMORY_UTILIZATION" not in engine | stack
    assert stack["ALISE_EMBEDDER"] == "x" and "retrieval" in prediction_source(stack)


@pytest.mark.slow
def test_cpu_device_run_measures_engine_and_stack(tmp_path, capsys):
    from lab.launcher.serve_stack import free_local_ports
    from lab.scheduler.testing import cached_tiny_model

    out = tmp_path / "stack.json"
    extra = (
        f"ALISE_INTERNAL_PORT_BASE={free_local_ports(1, 1).base},"
        "ALISE_KV_MEMORY_GB=0.1,ALISE_SWAP_MEMORY_GB=0.1"
    )
    args = _args(
        "--device", "cpu", "--model", str(cached_tiny_model()), "--load-format", "dummy",
        "--rates", "32", "--num-prompts", "6", "--max-tokens", "12",
        "--extra-env", extra, "--json", str(out),
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    engine = result["engine_alone"]
    assert engine["num_requests"] == 6 and engine["throughput_tok_s"] > 0
    assert engine["output_tokens"] <= 6 * 12
    assert engine["step_shape_from"].startswith("hybrid defaults")
    (point,) = result["points"]
    assert (
        point["rate"] == 32.0
        and point["prompt_offset"] == 0
        and point["completed"] == 6
        and point["num_errors"] == 0
    )
    for key in ("median_ttft_s", "p99_ttft_s", "mean_tbt_s", "p99_tbt_s"):
        assert point[key] is not None and point[key] >= 0
    assert point["service_cpu_s"]["executor"] > 0
    assert result["stack_over_engine"] == round(
        point["throughput_tok_s"] / engine["throughput_tok_s"], 3
    )
    assert result["prediction"] == "prior-only predictor (ALISE_EMBEDDER=none)"
    assert result["max_tokens_mode"] == "fixed (EOS honoured)"
    assert result["stack_warm_up"]["num_errors"] == 0
    assert "interrupted" not in result and "stack_error" not in result
    assert "[bench stack" in capsys.readouterr().out
