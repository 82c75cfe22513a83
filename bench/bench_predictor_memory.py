"""`alise bench predictor-memory`: the predictor service alone under a steady Predict+Observe
load, one process per `--trim-s` value side by side; what does its resident memory do?

Each variant is its own `alise predictor serve` process (own data dir, embedded Qdrant Edge
store seeded as on any start; the embeddings cache of the default data dir is copied in when
there is one, so the seed only writes points) with `ALISE_PREDICTOR_TRIM_S` set to its value
(0 = the allocator is never asked to give free pages back). Every variant gets the same
Poisson load over real gRPC, the calls the gateway makes per request: Predict of the
chat-formatted prompt, then Observe of its length (half greedy, half sampled; lengths drawn
up to `--max-tokens`, cut ones censored). Every `--sample-s` seconds it reads each process's
`/proc/<pid>/smaps`: resident set, its anonymous part (heap, arenas) and its file-backed
part (the embedder's weights, the store's memory-mapped files). Per variant and
series: first/last/min/max, and after `--warmup-s` the fitted growth per hour with the
residuals' spread (as `alise bench soak`), plus the trims' durations from its metrics.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.bench_soak import TOPICS, fit
from lab.workload.report import emit_json

SERIES = ("rss", "anon", "file", "embedder_file", "store_file")
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat(text: str) -> str:
    """The prompt text the gateway sends for one user message (SmolLM2's ChatML)."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def prompts(kind: str) -> list[str]:
    """`sharegpt`: the bundled ShareGPT test split's prompts; `soak`: `alise bench soak`'s."""
    if kind == "soak":
        return [f"Tell me something about {TOPICS[i % len(TOPICS)]} ({i})." for i in range(20000)]
    from services.predictor.sharegpt import load_split

    return [s.prompt for s in load_split("test")]


def memory_kib(pid: int) -> dict[str, int] | None:
    """Resident KiB of a process from /proc/<pid>/smaps: `rss`, its `anon` part (heap, arenas)
    and its file-backed part `file`, split into `embedder_file` (the embedder's memory-mapped
    weights: a word piece's row is read in on its first use) and `store_file` (the store's
    memory-mapped segments and write-ahead log). None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    out = dict.fromkeys(("rss", "anon", "embedder_file", "store_file"), 0)
    path = ""
    for line in text.splitlines():
        parts = line.split()
        if not parts[0].endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            path = parts[5] if len(parts) > 5 else ""
        elif parts[0] == "Rss:":
            out["rss"] += int(parts[1])
            if path.endswith(".safetensors"):
                out["embedder_file"] += int(parts[1])
            elif "/qdrant-edge/" in path:
                out["store_file"] += int(parts[1])
        elif parts[0] == "Anonymous:":
            out["anon"] += int(parts[1])
    out["file"] = out["rss"] - out["anon"]
    return out


@dataclass
class Variant:
    trim_s: float
    run_dir: Path
    port: int = 0
    metrics_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    calls: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"trim_s={self.trim_s:g}"

    def start(self, cache: Path | None) -> None:
        from services.common.redis_runner import free_port

        data = self.run_dir / "data"
        if cache is not None and cache.is_dir():
            shutil.copytree(cache, data / "predictor" / "embeddings")
        self.port, self.metrics_port = free_port(), free_port()
        env = {
            **os.environ,
            "ALISE_DATA_DIR": str(data),
            "ALISE_PREDICTOR_PORT": str(self.port),
            "ALISE_METRICS_PORT": str(self.metrics_port),
            "ALISE_PREDICTOR_TRIM_S": str(self.trim_s),
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.run_dir / "predictor.out", "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services", "predictor", "serve"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_seeded(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        log = self.run_dir / "predictor.out"
        while "seeding finished" not in log.read_text(errors="replace"):
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not seeded after {timeout_s:.0f} s")
            time.sleep(1)

    def trim_seconds(self) -> dict[str, float]:
        """Count, total and largest duration of its trims, from its Prometheus histogram."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        name = "alise:predictor_heap_trim_seconds"
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith(name)
        }
        buckets = [
            (float(k.split('le="')[1].split('"')[0]), v)
            for k, v in values.items()
            if "_bucket" in k and "+Inf" not in k
        ]
        count = values.get(f"{name}_count", 0.0)
        largest = min((b for b, n in buckets if n >= count), default=float("inf"))
        return {
            "count": count,
            "total_s": round(values.get(f"{name}_sum", 0.0), 4),
            "largest_at_most_s": largest if count else 0.0,
        }

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def drive(variant: Variant, args: argparse.Namespace, texts: list[str], stop_at: float) -> None:
    """The same Poisson sequence of Predict + Observe calls for every variant (seeded)."""
    from services.common.grpc_client import sync_channel
    from services.common.pb import predictor_pb2, predictor_pb2_grpc

    rng = random.Random(args.seed)
    model = args.model_id
    with sync_channel(f"127.0.0.1:{variant.port}") as channel:
        stub = predictor_pb2_grpc.PredictorStub(channel)
        i = 0
        while time.monotonic() < stop_at:
            prompt = chat(texts[i % len(texts)])
            temperature = 0.8 if i % 2 else 0.0
            length = rng.randint(1, args.max_tokens + 8)
            obs = predictor_pb2.Observation(
                request_id=f"r{i}",
                prompt=prompt,
                true_length=min(length, args.max_tokens),
                censored=length >= args.max_tokens,
            )
            try:
                stub.Predict(
                    predictor_pb2.PredictRequest(
                        model=model, prompts=[prompt], temperature=temperature
                    ),
                    timeout=30,
                )
                stub.Observe(
                    predictor_pb2.ObserveRequest(
                        model=model, observations=[obs], temperature=temperature
                    ),
                    timeout=30,
                )
                variant.calls += 1
            except Exception as exc:  # counted; the run goes on
                variant.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            i += 1
            time.sleep(rng.expovariate(args.rate))


def sample_until(variants: list[Variant], every_s: float, done: threading.Event) -> None:
    t0 = time.monotonic()
    while not done.is_set():
        at = round(time.monotonic() - t0, 1)
        for v in variants:
            got = memory_kib(v.process.pid) if v.process else None
            if got is not None:
                v.samples.append((at, got))
        done.wait(every_s)


def summary(variant: Variant, warmup_s: float) -> dict:
    out: dict = {"observations": variant.calls, "errors": variant.errors[:5]}
    for key in SERIES:
        points = [(t, s[key] / 1024) for t, s in variant.samples]
        steady = [(t, v) for t, v in points if t >= warmup_s]
        values = [v for _, v in points]
        row = {
            "first": round(values[0], 1),
            "last": round(values[-1], 1),
            "min": round(min(values), 1),
            "max": round(max(values), 1),
        }
        if len(steady) >= 3:
            slope, noise = fit(steady)
            row.update(
                growth_per_hour=round(slope * 3600, 2),
                residual_sd=round(noise, 2),
                growth_over_window=round(slope * (steady[-1][0] - steady[0][0]), 2),
                samples_fitted=len(steady),
            )
        out[f"{key}_mib"] = row
    return out


def run(args: argparse.Namespace, root: Path) -> dict:
    from services.common.models import served_model_id
    from services.common.settings import PredictorSettings

    settings = PredictorSettings()
    args.model_id = served_model_id(settings.model)
    cache = Path(settings.data_dir) / "predictor" / "embeddings"
    variants = [Variant(t, root / f"v{i}") for i, t in enumerate(args.trim_s)]
    try:
        for v in variants:
            v.run_dir.mkdir(parents=True)
            v.start(cache)
        for v in variants:
            v.wait_seeded(args.seed_timeout_s)
        texts = prompts(args.prompts)
        done = threading.Event()
        sampler = threading.Thread(target=sample_until, args=(variants, args.sample_s, done))
        sampler.start()
        stop_at = time.monotonic() + args.minutes * 60
        drivers = [threading.Thread(target=drive, args=(v, args, texts, stop_at)) for v in variants]
        for d in drivers:
            d.start()
        for d in drivers:
            d.join()
        done.set()
        sampler.join()
        trims = {v.name: v.trim_seconds() for v in variants}
    finally:
        for v in variants:
            v.stop()
    return {
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "minutes": args.minutes,
        "rate_per_s": args.rate,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "sample_s": args.sample_s,
        "warmup_s": args.warmup_s,
        "seed": args.seed,
        "variants": {
            v.name: {**summary(v, args.warmup_s), "trims": trims[v.name]} for v in variants
        },
        "samples": {v.name: [[t, *(s[k] for k in SERIES)] for t, s in v.samples] for v in variants},
        "samples_columns": ["seconds", *(f"{k}_kib" for k in SERIES)],
    }


def _run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="alise-bench-predmem-") as tmp:
        out = run(args, Path(tmp))
    emit_json(out, args.json)
    for name, row in out["variants"].items():
        rss, anon = row["rss_mib"], row["anon_mib"]
        print(
            f"{name}: RSS {rss['first']} -> {rss['last']} MiB "
            f"({rss.get('growth_per_hour')} MiB/h), anonymous {anon['first']} -> {anon['last']} "
            f"({anon.get('growth_per_hour')} MiB/h), {row['observations']} observations"
        )
    return 0 if all(not r["errors"] for r in out["variants"].values()) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "predictor-memory",
        help="the predictor alone under Predict+Observe load: resident memory per trim setting",
    )
    p.add_argument("--minutes", type=float, default=12.0, help="load duration")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (one Predict + Observe)")
    p.add_argument(
        "--trim-s",
        type=float,
        nargs="+",
        default=[0.0, 60.0],
        help="ALISE_PREDICTOR_TRIM_S of each process run side by side (0 = never trim)",
    )
    p.add_argument("--prompts", choices=("sharegpt", "soak"), default="sharegpt")
    p.add_argument("--max-tokens", type=int, default=32, help="cap of the observed lengths")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=120.0, help="left out of the fitted line")
    p.add_argument("--seed-timeout-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    p.set_defaults(func=_run)
