"""`alise predictor eval --target served`: the predictors scored against the served model's
own lengths (`alise predictor calibrate`: its answers to ShareGPT prompts, EOS honoured, one
cap).

The test set is the test-split calibration file when there is one (prompts never seeded into
the store); otherwise every fifth prompt of the train-split file is held out. Three set-ups
are scored on it, everything else equal (embedder, k, s0, the MLP recipe):

- `reference`: the store and the MLP hold ShareGPT's reference answer lengths of the train
  split (minus any held-out prompt): the seed of a model with no calibration;
- `served`: they hold the served model's lengths, a cut answer counted as if it had ended at
  the cap;
- `served_censored`: the same lengths with their censored flags: the store keeps the share
  of cut answers per point and the MLP its P(runs to the cap) head (the default seed).

A censored answer only says its true length is >= the cap, so Kendall tau, bucket accuracy
and the relative error are over the uncensored test answers (ties at the cap excluded).
Reported apart: the censored share, the AUC of `p_capped` for telling them (0.5 = no better
than chance), and tau and the mean absolute error of the length the scheduler uses
(`expected_length` at the cap) over every answer, cut ones counted at the cap.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lab.predictor.metrics_eval import accuracy, auc
from services.common.censoring import expected_length

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings
    from services.predictor.sharegpt import Sample

SETUPS = ("reference", "served", "served_censored")


def split_calibrated(
    train: list[Sample], rows: dict[str, dict], every: int = 5
) -> tuple[list[Sample], list[Sample], np.ndarray]:
    """(calibrated fit samples, held-out test samples, censored flags of the test samples),
    lengths = the served model's; in train-split order."""
    from services.predictor.calibration_files import calibrated_samples

    cal = calibrated_samples(train, rows)
    test = cal[::every]
    fit = [s for i, s in enumerate(cal) if i % every]
    return fit, test, censored_flags(test, rows)


def censored_flags(samples: list[Sample], rows: dict[str, dict]) -> np.ndarray:
    return np.array([bool(rows[s.id]["censored"]) for s in samples], bool)


def score(
    pred: np.ndarray, p_capped: np.ndarray, true: np.ndarray, censored: np.ndarray, cap: int
) -> dict:
    """Accuracy over the uncensored answers; the cut ones and the scheduler's length apart."""
    from scipy.stats import kendalltau

    ok = ~censored
    expected = np.array([expected_length(n, p, cap) for n, p in zip(pred, p_capped)], float)
    seen = np.minimum(true, cap)
    return {
        **accuracy(pred[ok], true[ok]),
        "censored_share": float(censored.mean()),
        "capped_auc": auc(np.asarray(p_capped, float), censored),
        "expected_mae": float(np.mean(np.abs(expected - seen))),
        "expected_tau_with_cap_ties": (
            float(kendalltau(expected, seen)[0]) if np.ptp(expected) else 0.0
        ),
    }


def _setup(settings, embedder, chat, fit: list[Sample], cut, test: list[Sample], model: str):
    """(preds, hits, p_capped) per method, store and MLP fit on `fit` (`cut`: censored flags
    of `fit`, or None to treat every length as complete)."""
    from lab.predictor.eval_common import predictions, search_all, seeded_store
    from services.predictor.build import embedding_cache
    from services.predictor.mlp import length_feature, train

    fit_p, test_p = [chat(s.prompt) for s in fit], [chat(s.prompt) for s in test]
    cache = embedding_cache(settings, embedder)
    x_fit, x_test = cache.embed(fit_p), cache.embed(test_p)
    f_fit, f_test = (length_feature(embedder.prepare(p)) for p in (fit_p, test_p))
    y_fit = np.array([s.output_len for s in fit], np.float32)
    mlp = train(x_fit, f_fit, y_fit, censored=cut, log=None)
    k, s0, prior = settings.predictor_top_k, settings.predictor_threshold, float(y_fit.mean())
    with tempfile.TemporaryDirectory() as tmp:
        store = seeded_store(embedder.dim, model, Path(tmp), x_fit, y_fit, cut)
        neighbors = search_all(store, model, x_test, k)
        mlp_len, mlp_cap = mlp.predict(x_test, f_test), mlp.predict_capped(x_test, f_test)
        got = predictions(neighbors, mlp_len, prior, s0, len(test), mlp_cap)
        store.close()
    return got


def held_out(settings: PredictorSettings, args: argparse.Namespace) -> dict:
    """The fit and test sets: the test-split calibration when there is one, else every
    fifth train-split calibrated prompt."""
    from services.predictor.calibration_files import calibrated_samples, calibration_file
    from services.predictor.calibration_files import read_calibration as read
    from services.predictor.sharegpt import load_split

    path = Path(args.file) if args.file else calibration_file(settings.model, settings.data_dir)
    if path is None:
        raise SystemExit("no calibration file: run `alise predictor calibrate` or pass --file")
    header, rows = read(path)
    train = load_split("train", settings.model, settings.data_dir)
    test_path = Path(args.test_file) if getattr(args, "test_file", None) else None
    test_path = test_path or calibration_file(
        settings.model, settings.data_dir, header["max_tokens"], "test"
    )
    if test_path is not None:
        _, test_rows = read(test_path)
        fit = calibrated_samples(train, rows)
        test = calibrated_samples(load_split("test", settings.model, settings.data_dir), test_rows)
        cut_fit, cut_test = censored_flags(fit, rows), censored_flags(test, test_rows)
    else:
        fit, test, cut_test = split_calibrated(train, rows)
        cut_fit = censored_flags(fit, rows)
    if args.limit:
        fit, cut_fit = fit[: 4 * args.limit], cut_fit[: 4 * args.limit]
        test, cut_test = test[: args.limit], cut_test[: args.limit]
    held = {s.id for s in test}
    reference = [s for s in train if s.id not in held][: args.limit_reference]
    files = {"fit": str(path), "test": str(test_path) if test_path else "every 5th of fit"}
    return {"header": header, "files": files, "fit": fit, "cut_fit": cut_fit, "test": test,
            "cut_test": cut_test, "reference": reference}  # fmt: skip


def run(settings: PredictorSettings, args: argparse.Namespace) -> dict:
    if getattr(args, "regime", None):  # one temperature regime against several draws
        from lab.predictor.regime_eval import run as run_regime

        return run_regime(settings, args)
    from lab.predictor.eval_common import chat_formatter
    from services.predictor.build import make_embedder, served_models

    data = held_out(settings, args)
    test, cut, cap = data["test"], data["cut_test"], data["header"]["max_tokens"]
    true = np.array([s.output_len for s in test], np.float64)
    model = served_models(settings)[0]
    embedder, chat = make_embedder(settings), chat_formatter(settings)
    out: dict = {"files": data["files"], "header": data["header"], "test": len(test),
                 "censored_share": float(cut.mean()), "setups": {}}  # fmt: skip
    fits = {
        "reference": (data["reference"], None),
        "served": (data["fit"], None),
        "served_censored": (data["fit"], data["cut_fit"]),
    }
    for name in SETUPS:
        fit, cut_fit = fits[name]
        preds, hits, capped = _setup(settings, embedder, chat, fit, cut_fit, test, model)
        out["setups"][name] = {
            "fit": len(fit),
            "methods": {
                m: {
                    **score(np.asarray(p, np.float64), capped[m], true, cut, cap),
                    "hit_rate": hits[m],
                }
                for m, p in preds.items()
            },
        }
    return out


def main(args: argparse.Namespace) -> int:
    from lab.workload.report import emit_json
    from services.common.settings import PredictorSettings

    emit_json(run(PredictorSettings(), args), getattr(args, "json", None))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progressive",
        action="store_true",
        help="score the executor's remaining-length probe at 0/16/32/64 generated tokens "
        "on the test-split draws (lab/predictor/progressive.py)",
    )
    p.add_argument("--cap", type=int, default=256, help="--progressive: the calibration cap")
    p.add_argument(
        "--refit",
        action="store_true",
        help="--progressive: fit the probe on the train split's features here instead of "
        "reading the shipped one",
    )
    p.add_argument("--file", help="train-split calibration JSONL (default: the served model's)")
    p.add_argument(
        "--test-file", help="test-split calibration JSONL (default: the served model's, if any)"
    )
    p.add_argument("--limit", type=int, default=None, help="first N test prompts (and 4N fit)")
    p.add_argument(
        "--limit-reference", type=int, default=None, help="first N ShareGPT reference samples"
    )
    from lab.predictor.regime_eval import add_arguments as regime_arguments

    regime_arguments(p)
