"""`alise predictor eval --target served --progressive`: how well the executor's probe
(services/executor/probe.py) predicts a running request's remaining length, on held-out
(test-split) prompts, at each checkpoint (0, 16, 32, 64 generated tokens), per temperature
regime, over the draws still running there.

Per checkpoint: Kendall τ-b between the predicted and the true remaining tokens (counted to
the cap, so draws cut by the cap tie at cap - generated; the prediction ranked is the
expected remaining under the cap, `(1 - p_cap) · min(q50, left) + p_cap · left`, what a
scheduler ranks by, and q50 alone beside it), cap-AUC (p_cap against the draws that ran to the
cap), the median and mean relative error of q50, and the coverage of [q10, q90]. Beside them
the draw-to-draw ceiling (temperature > 0, prompts with at least two draws still running):
τ between two draws of the same prompt (draw 0 vs 1 and 2 vs 3), and the best a prompt-only
predictor can do, each draw scored by the mean remaining of the prompt's other draws
(τ, and AUC of their capped share). Also, as ablations, probes fit on the scalar features
alone and on the hidden state alone, and the scalar `generated`-only baseline (constant at a
checkpoint: τ 0). Files: the test-split calibration files of each regime and their
`.features.npz`; the probes shipped in services/executor/probes/ (or fit here on the train
split's features with `--refit`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from services.executor.probe import SCALAR_NAMES, Probe, ProbeBank
from services.predictor.calibration_files import (
    FeatureRows,
    calibration_file,
    draws_file,
    features_path,
    read_features,
)

log = logging.getLogger(__name__)

CHECKPOINTS = (0, 16, 32, 64)


def _tau(pred: np.ndarray, true: np.ndarray) -> float | None:
    from scipy.stats import kendalltau

    if len(pred) < 3 or np.ptp(pred) == 0 or np.ptp(true) == 0:
        return None
    return round(float(kendalltau(pred, true)[0]), 4)


def _auc(score: np.ndarray, label: np.ndarray) -> float | None:
    from lab.predictor.metrics_eval import auc

    value = auc(np.asarray(score, np.float64), np.asarray(label, bool))
    return None if value is None else round(value, 4)


def predict(probe: Probe, rows: FeatureRows, cap: int) -> dict[str, np.ndarray]:
    """The probe's q10/q50/q90 (tokens), p_cap and expected remaining for every row."""
    import torch

    raw = probe.raw(torch.from_numpy(rows.x.astype(np.float32))).numpy().astype(np.float64)
    left = np.maximum(1.0, cap - rows.generated.astype(np.float64))
    q = np.clip(np.expm1(raw[:, :3]), 1.0, left[:, None])
    p = 1.0 / (1.0 + np.exp(-np.clip(raw[:, 3], -30, 30)))
    return {"q10": q[:, 0], "q50": q[:, 1], "q90": q[:, 2], "p_cap": p,
            "expected": (1 - p) * q[:, 1] + p * left}  # fmt: skip


def checkpoint_metrics(pred: dict[str, np.ndarray], rows: FeatureRows) -> dict:
    true = rows.remaining.astype(np.float64)
    rel = np.abs(pred["q50"] - true) / true
    inside = (pred["q10"] <= true) & (true <= pred["q90"])
    return {
        "running": len(rows),
        "capped_share": round(float(rows.censored.mean()), 4),
        "tau": _tau(pred["expected"], true),
        "tau_q50": _tau(pred["q50"], true),
        "cap_auc": _auc(pred["p_cap"], rows.censored),
        "median_relative_error": round(float(np.median(rel)), 4),
        "mean_relative_error": round(float(rel.mean()), 4),
        "coverage_q10_q90": (
            None if np.array_equal(pred["q10"], pred["q90"]) else round(float(inside.mean()), 4)
        ),  # None: a point prediction
    }


def draw_ceiling(rows: FeatureRows) -> dict:
    """Draw-to-draw agreement at one checkpoint (rows of that checkpoint only)."""
    by_prompt: dict[str, dict[int, tuple[int, bool]]] = {}
    for pid, d, rem, cut in zip(rows.ids, rows.draw, rows.remaining, rows.censored, strict=True):
        by_prompt.setdefault(str(pid), {})[int(d)] = (int(rem), bool(cut))
    a, b, loo, loo_cap, mine, mine_cut = [], [], [], [], [], []
    for draws in by_prompt.values():
        for x, y in ((0, 1), (2, 3)):
            if x in draws and y in draws:
                a.append(draws[x][0])
                b.append(draws[y][0])
        if len(draws) < 2:
            continue
        for d, (rem, cut) in draws.items():
            others = [v for k, v in draws.items() if k != d]
            loo.append(np.mean([o[0] for o in others]))
            loo_cap.append(np.mean([o[1] for o in others]))
            mine.append(rem)
            mine_cut.append(cut)
    return {
        "pairs": len(a),
        "tau_draw_pair": _tau(np.asarray(a, float), np.asarray(b, float)),
        "tau_prompt_mean": _tau(np.asarray(loo), np.asarray(mine, float)),
        "cap_auc_prompt_share": _auc(np.asarray(loo_cap), np.asarray(mine_cut, bool)),
    }


def arrival_predictions(ids: list[str], cap: int, reg: str) -> dict[str, tuple[float, float]]:
    """The arrival-time predictor's (expected length under the cap, p_capped) per test prompt
    id: `ours` (retrieval + MLP, services/predictor) fit on the train-split calibration file
    the service seeds regime `reg` from."""
    from lab.predictor.eval_common import chat_formatter
    from lab.predictor.served_eval import _setup, censored_flags
    from services.common.censoring import expected_length
    from services.common.settings import PredictorSettings
    from services.predictor.build import make_embedder, served_models
    from services.predictor.calibration_files import calibrated_samples, read_calibration
    from services.predictor.sharegpt import load_split

    settings = PredictorSettings()
    path = calibration_file(settings.model, Path(settings.data_dir), cap, regime=reg)
    if path is None:
        return {}
    _, rows = read_calibration(path)
    fit = calibrated_samples(load_split("train", settings.model, settings.data_dir), rows)
    wanted = set(ids)
    test = [s for s in load_split("test", settings.model, settings.data_dir) if s.id in wanted]
    embedder, chat = make_embedder(settings), chat_formatter(settings)
    model = served_models(settings)[0]
    preds, _, capped = _setup(settings, embedder, chat, fit, censored_flags(fit, rows), test, model)
    return {
        s.id: (float(expected_length(length, p, cap)), float(p))
        for s, length, p in zip(test, preds["ours"], capped["ours"], strict=True)
    }


def arrival_rows(arrival: dict[str, tuple[float, float]], rows: FeatureRows, cap: int) -> dict:
    """The arrival-time prediction as a forecast at every checkpoint: expected length minus
    the tokens generated (never revised), p_capped unchanged."""
    known = np.asarray([arrival.get(str(p), (np.nan, np.nan)) for p in rows.ids], np.float64)
    left = np.maximum(1.0, cap - rows.generated.astype(np.float64))
    remaining = np.clip(known[:, 0] - rows.generated, 1.0, left)
    return {"q10": remaining, "q50": remaining, "q90": remaining, "p_cap": known[:, 1],
            "expected": remaining}  # fmt: skip


def regime_table(
    probes: dict[str, Probe],
    rows: FeatureRows,
    cap: int,
    ceiling: bool,
    arrival: dict[str, tuple[float, float]] | None = None,
) -> dict:
    """{checkpoint: {probe name: metrics, "ceiling": ...}} for one regime's test rows."""
    preds = {name: predict(p, rows, cap) for name, p in probes.items()}
    if arrival:
        preds["arrival"] = arrival_rows(arrival, rows, cap)
    table = {}
    for g in CHECKPOINTS:
        mask = rows.generated == g
        if not mask.any():
            continue
        sub = rows.select(mask)
        entry = {name: checkpoint_metrics({k: v[mask] for k, v in pr.items()}, sub)
                 for name, pr in preds.items()}  # fmt: skip
        if ceiling:
            entry["ceiling"] = draw_ceiling(sub)
        table[str(g)] = entry
    return table


def ablations(train: FeatureRows, model: str, cap: int, reg: str, seed: int) -> dict[str, Probe]:
    """Probes fit here on parts of the features (what each part buys)."""
    from lab.predictor.probe_train import train_probe

    n_scalar = len(SCALAR_NAMES)
    width = train.x.shape[1]
    cols = {
        "scalars_only": list(range(n_scalar)),
        "hidden_only": list(range(n_scalar, width)),
        "progress_only": [0, 1, 2],  # generated, left, prompt length
    }
    return {
        name: train_probe(train, model=model, cap=cap, regime=reg, seed=seed, columns=c)
        for name, c in cols.items()
    }


def run(
    model: str, cap: int, data_dir: Path, refit: bool, seed: int = 0, arrival: bool = True
) -> dict:
    from lab.predictor.probe_train import train_probe

    bank = ProbeBank.for_model(model)
    out: dict = {"model": model, "cap": cap, "checkpoints": list(CHECKPOINTS), "regimes": {}}
    for reg in ("t1", "t0"):
        test_file = draws_file(model, data_dir, cap, "test", reg)
        train_file = draws_file(model, data_dir, cap, "train", reg)
        if test_file is None or train_file is None or not features_path(test_file).exists():
            log.warning("no %s calibration with features for %s: skipped", reg, model)
            continue
        test = read_features(features_path(test_file))
        train = read_features(features_path(train_file))
        shipped = [p for p in (bank.probes if bank else []) if p.regime == reg and p.cap == cap]
        probe = (
            shipped[0]
            if shipped and not refit
            else train_probe(train, model=model, cap=cap, regime=reg, seed=seed)
        )
        probes = {"probe": probe, **ablations(train, model, cap, reg, seed)}
        ids = sorted(set(test.ids.tolist()))
        before = arrival_predictions(ids, cap, reg) if arrival else None
        out["regimes"][reg] = {
            "files": {"train": train_file.name, "test": test_file.name},
            "test_prompts": len(ids),
            "test_rows": len(test),
            "train_rows": len(train),
            "table": regime_table(probes, test, cap, reg == "t1", before),
        }
    t1 = out["regimes"].get("t1", {}).get("table", {}).get("32", {}).get("probe", {})
    out["tau_remaining_at_32"] = t1.get("tau")
    out["cap_auc_at_32"] = t1.get("cap_auc")
    return out


def main(args: argparse.Namespace) -> int:
    from lab.workload.report import emit_json
    from services.common.models import served_model_id
    from services.common.settings import PredictorSettings

    settings = PredictorSettings()
    model = served_model_id(settings.model)
    result = run(model, args.cap, Path(settings.data_dir), args.refit)
    emit_json(result, getattr(args, "json", None))
    return 0
