"""`alise predictor eval-served`: the predictors scored against the served model's own lengths.

The test set is every fifth prompt of a calibration file (`alise predictor calibrate`: the
served model's answer lengths for train-split prompts, EOS honoured, one cap). Two set-ups are
scored on it, everything else equal (embedder, k, s0, the MLP recipe):

- `reference`: the store and the MLP hold ShareGPT's reference answer lengths of the train
  split (minus the test prompts): what the predictor seeds from today;
- `served`: they hold the served model's lengths of the other calibrated prompts.

A censored answer (cut by the cap) only says its true length is >= the cap, so Kendall tau and
the relative error are computed over the uncensored test answers, and censored ones are
reported apart: their share, and how often each method predicts at least 90% of the cap for
them (and for the uncensored ones, which should not).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.predictor.metrics_eval import accuracy

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings
    from services.workload.traces.sharegpt import Sample


def split_calibrated(
    train: list[Sample], rows: dict[str, dict], every: int = 5
) -> tuple[list[Sample], list[Sample], np.ndarray]:
    """(calibrated fit samples, held-out test samples, censored flags of the test samples),
    lengths = the served model's; in train-split order."""
    from services.predictor.calibrate import calibrated_samples

    cal = calibrated_samples(train, rows)
    test = cal[::every]
    fit = [s for i, s in enumerate(cal) if i % every]
    return fit, test, np.array([bool(rows[s.id]["censored"]) for s in test])


def score(pred: np.ndarray, true: np.ndarray, censored: np.ndarray, cap: int) -> dict:
    """Accuracy over the uncensored answers; how the censored ones were met."""
    ok = ~censored
    high = pred >= 0.9 * cap
    return {
        **accuracy(pred[ok], true[ok]),
        "censored_share": float(censored.mean()),
        "predicts_cap_when_censored": float(high[censored].mean()) if censored.any() else None,
        "predicts_cap_when_not": float(high[ok].mean()) if ok.any() else None,
    }


def _setup(settings, embedder, chat, fit: list[Sample], test: list[Sample], model: str) -> dict:
    from services.predictor.build import embedding_cache
    from services.predictor.evaluate import _predictions, _search_all, _seeded_store
    from services.predictor.mlp import length_feature, train

    fit_p, test_p = [chat(s.prompt) for s in fit], [chat(s.prompt) for s in test]
    cache = embedding_cache(settings, embedder)
    x_fit, x_test = cache.embed(fit_p), cache.embed(test_p)
    f_fit, f_test = (length_feature(embedder.prepare(p)) for p in (fit_p, test_p))
    y_fit = np.array([s.output_len for s in fit], np.float32)
    mlp = train(x_fit, f_fit, y_fit)
    k, s0, prior = settings.predictor_top_k, settings.predictor_threshold, float(y_fit.mean())
    with tempfile.TemporaryDirectory() as tmp:
        store = _seeded_store(embedder.dim, model, Path(tmp), x_fit, y_fit)
        neighbors = _search_all(store, model, x_test, k)
        preds, hits = _predictions(neighbors, mlp.predict(x_test, f_test), prior, s0, len(test))
        store.close()
    return {"preds": preds, "hits": hits, "fit": len(fit)}


def run(settings: PredictorSettings, args: argparse.Namespace) -> dict:
    from services.predictor.build import make_embedder, served_models
    from services.predictor.calibrate import calibration_file, read_calibration
    from services.predictor.evaluate import chat_formatter
    from services.workload.traces.sharegpt import load_split

    path = Path(args.file) if args.file else calibration_file(settings.model, settings.data_dir)
    if path is None:
        raise SystemExit("no calibration file: run `alise predictor calibrate` or pass --file")
    header, rows = read_calibration(path)
    train = load_split("train", settings.model, settings.data_dir)
    fit, test, censored = split_calibrated(train, rows)
    if args.limit:
        fit, test, censored = fit[: 4 * args.limit], test[: args.limit], censored[: args.limit]
    held = {s.id for s in test}
    reference = [s for s in train if s.id not in held][: args.limit_reference]
    true = np.array([s.output_len for s in test], np.float64)
    model = served_models(settings)[0]
    embedder, chat = make_embedder(settings), chat_formatter(settings)
    out: dict = {
        "file": str(path),
        "header": header,
        "test": len(test),
        "censored_share": float(censored.mean()),
        "setups": {},
    }
    for name, fit_set in (("reference", reference), ("served", fit)):
        got = _setup(settings, embedder, chat, fit_set, test, model)
        out["setups"][name] = {
            "fit": got["fit"],
            "methods": {
                m: {
                    **score(np.asarray(p, np.float64), true, censored, header["max_tokens"]),
                    "hit_rate": got["hits"][m],
                }
                for m, p in got["preds"].items()
            },
        }
    return out


def main(args: argparse.Namespace) -> int:
    from services.common.settings import PredictorSettings
    from services.workload.report import emit_json

    emit_json(run(PredictorSettings(), args), args.json)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "eval-served", help="prior / mlp / retrieval / ours against the served model's lengths"
    )
    p.add_argument("--file", help="calibration JSONL (default: the served model's at cap 256)")
    p.add_argument("--limit", type=int, default=None, help="first N test prompts (and 4N fit)")
    p.add_argument(
        "--limit-reference", type=int, default=None, help="first N ShareGPT reference samples"
    )
    p.add_argument("--json", help="also write the figures here")
    p.set_defaults(func=main)
