"""`alise predictor eval --target served --regime t1|t0`: the arrival-time predictor of one
temperature regime scored against the prompts' length *distributions* (several draws per
test prompt), as the service builds it (`services.predictor.build`: store + MLP, Algorithm 1).

Fit set-ups, everything else equal (embedder, k, s0, the MLP recipe):
- `one_draw`: the regime's train file, first draw of each prompt only (the store as it was
  before several draws: one length per prompt);
- `median_spread`: every draw: per prompt the median length of the draws that ended, the share
  cut at the cap and the spread (`services.predictor.regimes.summarize_draws`; the default);
- `other_regime`: the other regime's train file (median/spread), what a request of this regime
  gets while this regime has no file (the service's fallback);
- `several_draws_file`: the regime's several-draws train file (bundled apart in
  services/predictor/calibration/draws/, with the probe's features) when the service seeds
  from another file: what seeding from it would give.
Test draws: the regime's several-draws test file when there is one, else the seeded kind.
With one draw per train prompt `one_draw` and `median_spread` are the same fit.

Targets per test prompt, from its draws (the regime's test file, plus `--more-draws` files of
the same prompts): the median length with cut draws counted at the cap (`med`; at the cap when
half or more were cut: "median cut"), the share cut, the spread of log1p lengths, and the
first draw alone (what one-draw scoring saw). Reported: Kendall tau of the predicted length
with `med` over prompts whose median ended; the AUC of `p_capped` for "median cut"; Spearman of
`p_capped` with the cut share; tau of the scheduler's expected length (cap ties in) with `med`;
tau and AUC against the first draw alone; Spearman of the predicted spread with the test
spread; and the draw-to-draw ceiling: tau between two draws of the same prompts (both ended).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lab.predictor.metrics_eval import auc

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings
    from services.predictor.build import SeedSet
    from services.predictor.calibration_files import PromptDraws
    from services.predictor.core import Prediction


def test_draws(settings: PredictorSettings, args: argparse.Namespace, regime: str):
    """(test file, id -> PromptDraws) with the draws of `--more-draws` files merged in."""
    from dataclasses import replace

    from services.predictor.build import served_models
    from services.predictor.calibration_files import DEFAULT_CAP, draws_file, read_draws
    from services.predictor.regimes import regime_file

    model, data_dir = served_models(settings)[0], Path(settings.data_dir)
    path = Path(args.test_file) if args.test_file else None
    path = path or draws_file(model, data_dir, DEFAULT_CAP, "test", regime)
    path = path or regime_file(model, data_dir, regime, split="test")
    if path is None:
        raise SystemExit(f"no test-split calibration file for regime {regime}")
    draws = read_draws(path)[1]
    for more in args.more_draws or []:
        for pid, d in read_draws(Path(more))[1].items():
            if pid in draws:
                old = draws[pid]
                draws[pid] = replace(
                    old, lengths=old.lengths + d.lengths, censored=old.censored + d.censored
                )
    return path, draws


def fits(settings: PredictorSettings, regime: str) -> dict[str, SeedSet]:
    """The fit set-ups (see the module's doc) that exist for `regime`."""
    from dataclasses import replace

    from services.predictor.build import SeedSet, regime_seed, served_models
    from services.predictor.calibration_files import DEFAULT_CAP, draws_file, read_draws
    from services.predictor.regimes import REGIMES, regime_file

    model, data_dir = served_models(settings)[0], Path(settings.data_dir)
    own = regime_file(model, data_dir, regime)  # a regime's draws/ file when it has no other
    if own is None:
        raise SystemExit(f"no train-split calibration file for regime {regime}")
    full = regime_seed(settings, regime, path=own)
    out = {"median_spread": full}
    if full.count.max() > 1:  # else the first draw is every draw: the same fit
        draws = read_draws(own)[1]
        first = [draws[s.id] for s in full.samples]
        out["one_draw"] = SeedSet.of(
            [replace(s, output_len=d.lengths[0]) for s, d in zip(full.samples, first)],
            np.array([d.censored[0] for d in first]),
            f"{own} (first draw)",
        )
    for other in REGIMES:
        if other != regime and regime_file(model, data_dir, other) is not None:
            out["other_regime"] = regime_seed(settings, other)
    several = draws_file(model, data_dir, DEFAULT_CAP, "train", regime)
    if several is not None and several != own:
        out["several_draws_file"] = regime_seed(settings, regime, path=several)
    return out


def predict_with(settings, embedder, seed_set: SeedSet, prompts: list[str]) -> list[Prediction]:
    """Seed a temporary store and train an MLP on `seed_set`; predict `prompts`."""
    from services.predictor.build import embedding_cache, seed, train_mlp
    from services.predictor.core import LengthPredictor
    from services.predictor.embedder import text_hash
    from services.predictor.store_edge import EdgeStore

    model = "eval"
    with tempfile.TemporaryDirectory() as tmp:
        store = EdgeStore(embedder.dim, Path(tmp) / "store")
        predictor = LengthPredictor(
            embedder, store, None, k=settings.predictor_top_k, s0=settings.predictor_threshold
        )
        seed(settings, predictor, model, seed_set=seed_set)
        lab = settings.model_copy(update={"data_dir": Path(tmp), "predictor_mlp_path": None})
        predictor.mlp, _ = train_mlp(lab, embedder, model, seed_set=seed_set)
        predictor.prior = predictor.mlp.cfg.prior
        vectors = embedding_cache(settings, embedder).embed(prompts)  # warm the predictor's
        for text, v in zip(embedder.prepare(prompts), vectors):
            predictor.cache.put(text_hash(text), v)
        preds = predictor.predict(model, prompts)
        store.close()
    return preds


def score(preds: list[Prediction], draws: list[PromptDraws], cap: int) -> dict:
    """The figures of the module's doc for one set-up."""
    from scipy.stats import kendalltau, spearmanr

    from services.common.censoring import expected_length

    length = np.array([p.length for p in preds], float)
    p_cap = np.array([p.p_capped for p in preds], float)
    med = np.array([min(d.median, cap) for d in draws])
    share = np.array([d.capped_share for d in draws])
    med_cut = share >= 0.5
    expected = np.array([expected_length(p.length, p.p_capped, cap) for p in preds], float)
    d0 = np.array([d.lengths[0] for d in draws], float)
    d0_cut = np.array([d.censored[0] for d in draws], bool)
    sp_true = np.array([d.log_spread for d in draws])
    sp_pred = np.array([p.spread for p in preds])
    many = np.array([len(d.lengths) > 1 for d in draws])

    def tau(a, b):
        return float(kendalltau(a, b)[0]) if len(a) > 2 and np.ptp(a) and np.ptp(b) else None

    return {
        "tau_median": tau(length[~med_cut], med[~med_cut]),
        "cap_auc_median": auc(p_cap, med_cut),
        "spearman_p_capped_share": float(spearmanr(p_cap, share)[0]) if np.ptp(p_cap) else None,
        "tau_expected_median_cap_ties": tau(expected, med),
        "tau_first_draw": tau(length[~d0_cut], d0[~d0_cut]),
        "cap_auc_first_draw": auc(p_cap, d0_cut),
        "spearman_spread": (
            float(spearmanr(sp_pred[many], sp_true[many])[0])
            if many.sum() > 2 and np.ptp(sp_pred[many])
            else None
        ),
        "spread_known_share": float(np.mean(sp_pred > 0)),
    }


def ceiling(draws: list[PromptDraws]) -> dict:
    """Draw-to-draw agreement of the test prompts' first two draws (the bound of any
    predictor of one draw)."""
    from scipy.stats import kendalltau

    two = [d for d in draws if len(d.lengths) > 1]
    both = [d for d in two if not d.censored[0] and not d.censored[1]]
    if len(both) < 3:
        return {"prompts_with_two_draws": len(two)}
    a, b = (np.array([d.lengths[i] for d in both]) for i in (0, 1))
    cut = np.array([d.censored[1] for d in two], bool)
    return {
        "prompts_with_two_draws": len(two),
        "tau_draw_to_draw": float(kendalltau(a, b)[0]),
        "both_ended": len(both),
        "cap_auc_draw_to_draw": auc(np.array([float(d.censored[0]) for d in two]), cut),
    }


def run(settings: PredictorSettings, args: argparse.Namespace) -> dict:
    from lab.predictor.eval_common import chat_formatter
    from services.predictor.build import make_embedder
    from services.predictor.calibration_files import read_draws
    from services.predictor.sharegpt import load_split

    regime = args.regime
    path, by_id = test_draws(settings, args, regime)
    cap = int(read_draws(path)[0].get("max_tokens", 256))
    tests = [s for s in load_split("test", settings.model, settings.data_dir) if s.id in by_id]
    tests = tests[: args.limit] if args.limit else tests
    draws = [by_id[s.id] for s in tests]
    chat = chat_formatter(settings)
    prompts = [chat(s.prompt) for s in tests]
    embedder = make_embedder(settings)
    out: dict = {"regime": regime, "test_file": str(path), "more_draws": args.more_draws,
                 "test": len(tests), "draws_per_prompt": float(np.mean([len(d.lengths)
                 for d in draws])), "ceiling": ceiling(draws), "setups": {}}  # fmt: skip
    for name, seed_set in fits(settings, regime).items():
        preds = predict_with(settings, embedder, seed_set, prompts)
        out["setups"][name] = {
            "fit": seed_set.source,
            "fit_prompts": len(seed_set.samples),
            "fit_draws": int(seed_set.count.sum()),
            **score(preds, draws, cap),
            "hit_rate": float(np.mean([p.source == "retrieval" for p in preds])),
        }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--regime",
        choices=("t1", "t0"),
        default=None,
        help="score one temperature regime's store+MLP against the test prompts' draws "
        "(lab/predictor/regime_eval.py)",
    )
    p.add_argument(
        "--more-draws",
        action="append",
        metavar="FILE",
        help="--regime: another test-split calibration file of the same prompts, its draws "
        "merged in (repeatable)",
    )
