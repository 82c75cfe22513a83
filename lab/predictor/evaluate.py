"""`alise predictor eval`: prior, MLP only, retrieval only, ours (Alg. 1), proxy on ShareGPT.

One run, one process, on the fixed test split. Test prompts are chat-formatted with the serving
model's template, as the gateway sends them. The store is a fresh Qdrant Edge shard holding
the whole train split; the MLP is trained here on the train split (so eval depends on no saved
state except the proxy, trained by `alise predictor train --proxy` or here when missing).

Latency: every method answers the same prompts one at a time, interleaved prompt by prompt so
machine noise hits all methods alike (p50/p99), then the same batches of 32 (prompts/s).
Each method runs through its own `LengthPredictor`, so none reuses another's embeddings.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lab.predictor.eval_common import chat_formatter, predictions, search_all, seeded_store
from lab.predictor.metrics_eval import accuracy
from services.predictor.core import LengthPredictor

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings

log = logging.getLogger(__name__)
METHODS = ("prior", "mlp", "retrieval", "ours", "proxy")


def _load(settings, args):
    from services.predictor.sharegpt import load_split

    train = load_split("train", settings.model, settings.data_dir)[: args.limit_train]
    test = load_split("test", settings.model, settings.data_dir)[: args.limit_test]
    return train, test


def _proxy(settings, args, model: str):
    from lab.predictor.proxy import ProxyPredictor, proxy_dir, train_proxy

    path = proxy_dir(settings, model)
    if not (path / "head.pt").exists():
        log.info("no proxy checkpoint: training one", extra=train_proxy(settings))
    return ProxyPredictor.load(path, settings.predictor_embed_tokens)


def _time(methods: dict, singles: list[str], batches: list[list[str]]) -> dict:
    for fn in methods.values():
        fn(["warm-up prompt"])
    times = {m: [] for m in methods}
    for prompt in singles:
        for m, fn in methods.items():
            t = time.perf_counter()
            fn([prompt])
            times[m].append(time.perf_counter() - t)
    batch_s = {m: 0.0 for m in methods}
    for batch in batches:
        for m, fn in methods.items():
            t = time.perf_counter()
            fn(batch)
            batch_s[m] += time.perf_counter() - t
    n = sum(len(b) for b in batches)
    ms = {m: np.array(t) * 1000 if t else np.full(1, np.nan) for m, t in times.items()}
    return {
        m: {
            "p50_ms": float(np.median(ms[m])),
            "p99_ms": float(np.percentile(ms[m], 99)),
            "batch32_prompts_per_s": n / batch_s[m] if batch_s[m] else float("nan"),
        }
        for m in methods
    }


def _timed_methods(
    embedder, store, mlp, proxy, model: str, prior: float, k: int, s0: float
) -> dict[str, Callable[[list[str]], object]]:
    """Each method as prompts -> lengths, each through its own `LengthPredictor` (the proxy,
    when there is one, through its own encoder)."""
    methods = {
        "prior": lambda ps: [prior] * len(ps),
        "mlp": LengthPredictor(embedder, None, mlp, prior, k, s0).predict,
        "retrieval": LengthPredictor(embedder, store, None, prior, k, -1.0).predict,
        "ours": LengthPredictor(embedder, store, mlp, prior, k, s0).predict,
    }
    methods = {m: partial(fn, model) if m != "prior" else fn for m, fn in methods.items()}
    if proxy is not None:
        methods["proxy"] = proxy.predict
    return methods


def run(settings: PredictorSettings, args: argparse.Namespace) -> dict:
    from services.predictor.build import embedding_cache, make_embedder, served_models
    from services.predictor.mlp import length_feature, train

    model = served_models(settings)[0]
    normalize = args.text == "norm"
    embedder = make_embedder(settings, normalize=normalize)
    chat = chat_formatter(settings)
    train_s, test_s = _load(settings, args)
    train_p = [chat(s.prompt) for s in train_s]
    test_p = [chat(s.prompt) for s in test_s]
    cache = embedding_cache(settings, embedder)
    t0 = time.perf_counter()
    x_tr, x_te = cache.embed(train_p), cache.embed(test_p)  # [N, D], [M, D]
    embed_s = time.perf_counter() - t0
    f_tr, f_te = (length_feature(embedder.prepare(p)) for p in (train_p, test_p))
    y_tr = np.array([s.output_len for s in train_s], np.float32)
    y_te = np.array([s.output_len for s in test_s], np.float32)
    mlp = train(x_tr, f_tr, y_tr, log=log.info)
    k, s0, prior = settings.predictor_top_k, settings.predictor_threshold, float(y_tr.mean())
    out: dict = {
        "config": {
            "text": args.text,
            "k": k,
            "s0": s0,
            "train": len(train_s),
            "test": len(test_s),
            "embed_tokens": embedder.max_seq_length,
            "embed_s_uncached": round(embed_s, 1),
            "store": "edge",
        },
        "methods": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        store = seeded_store(embedder.dim, model, Path(tmp), x_tr, y_tr)
        neighbors = search_all(store, model, x_te, k)
        preds, hits, _ = predictions(neighbors, mlp.predict(x_te, f_te), prior, s0, len(test_s))
        proxy = None if args.no_proxy else _proxy(settings, args, model)
        if proxy is not None:
            preds["proxy"] = np.maximum(
                np.round(
                    np.concatenate(
                        [proxy.predict(test_p[i : i + 64]) for i in range(0, len(test_p), 64)]
                    )
                ),
                1,
            )
            hits["proxy"] = 0.0
        methods = _timed_methods(embedder, store, mlp, proxy, model, prior, k, s0)
        n_single = min(args.latency_samples, len(test_p))
        batches = [test_p[n_single + 32 * b : n_single + 32 * (b + 1)] for b in range(args.batches)]
        timing = _time(methods, test_p[:n_single], [b for b in batches if b])
        store.close()
    for m in preds:
        out["methods"][m] = {**accuracy(preds[m], y_te), "hit_rate": hits[m], **timing[m]}
    if getattr(args, "write_predictions", None):
        write_predictions(Path(args.write_predictions), test_s, preds["ours"])
    return out


def write_predictions(path: Path, samples: list, lengths: np.ndarray) -> None:
    """{sample id: predicted length}: the simulator's `--prediction file:PATH`, so simulated
    sweeps schedule on what the real predictor says of each test prompt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = {s.id: int(n) for s, n in zip(samples, lengths)}
    path.write_text(json.dumps(table, sort_keys=True))
    log.info("wrote %d predictions to %s", len(table), path)


def table(result: dict) -> str:
    cols = (
        "bucket_accuracy",
        "mean_relative_error",
        "mae",
        "kendall_tau",
        "spearman",
        "hit_rate",
        "p50_ms",
        "p99_ms",
        "batch32_prompts_per_s",
    )
    lines = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m, row in result["methods"].items():
        lines.append(
            f"| {m} | "
            + " | ".join(f"{row[c]:.3f}" if row[c] < 100 else f"{row[c]:.0f}" for c in cols)
            + " |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from services.common.settings import PredictorSettings

    logging.basicConfig(level=logging.INFO)
    if getattr(args, "target", "reference") == "served":
        from lab.predictor import progressive, served_eval

        args.json = args.json_path
        return progressive.main(args) if args.progressive else served_eval.main(args)
    settings = PredictorSettings()
    result = run(settings, args)
    if args.tune:
        from lab.predictor.tune import sweep

        result["tuning"] = sweep(settings, args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    print(table(result))
    print(json.dumps(result["config"]))
    return 0
