"""Assemble a predictor from settings; seed its store and train its MLP.

Seeding bulk-loads prompts of the train split of `services.predictor.sharegpt` (the
fixed split the simulator uses too) with output lengths. When the served model has a
calibration file (`alise predictor calibrate`: its own answers' lengths at one cap, with
censored flags; one is bundled for SmolLM2) those prompts and lengths are the seed, and the
MLP learns P(runs to the cap) too. Otherwise the seed is ShareGPT's reference lengths (another
model's answers), with a warning.

Per temperature regime (`services.predictor.regimes`: `t1` sampled, `t0` greedy) the service
keeps its own collection and MLP, seeded from that regime's file (several draws per prompt:
the median, the cut share and the spread of the draws); a regime without a file is served by
`t1` (`services.predictor.by_regime`). The prompts' embeddings are cached on disk
(`<data_dir>/predictor/embeddings/`, keyed by embedder and text hash), so only the first seed
pays for embedding them.

`ALISE_EMBEDDER=none` builds a prior-only service instead (`prior_predictors`): no embedder,
store or MLP is loaded and nothing is seeded; every prediction is the prior.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.common.settings import PredictorSettings
from services.predictor.by_regime import RegimePredictors
from services.predictor.core import DEFAULT_PRIOR, LengthPredictor, VectorCache
from services.predictor.embedder import EMBED_CHUNK, SAVE_EVERY, Embedder, EmbeddingCache
from services.predictor.mlp import MlpRegressor, length_feature, train
from services.predictor.regimes import REGIMES, file_tag, regime_file
from services.predictor.store import open_store
from services.predictor.store_base import LengthStore, Record, point_id

if TYPE_CHECKING:
    from services.predictor.sharegpt import Sample

log = logging.getLogger(__name__)
NO_EMBEDDER = "none"  # ALISE_EMBEDDER=none: prior-only (no embedder, store, MLP or seed)


def served_models(settings: PredictorSettings) -> list[str]:
    """Model ids Predict/Observe accept (collections are keyed by them)."""
    from services.common.models import served_model_id

    ids = list(settings.predictor_models) or [served_model_id(settings.model)]
    return list(dict.fromkeys(ids))


def predictor_dir(settings: PredictorSettings) -> Path:
    return Path(settings.data_dir) / "predictor"


def mlp_path(settings: PredictorSettings, model: str, space: str = "") -> Path:
    """The MLP checkpoint of `model` for embedding space `space` (the configured path if set)."""
    name = f"mlp-{model}-{space}.pt" if space else f"mlp-{model}.pt"
    return Path(settings.predictor_mlp_path or predictor_dir(settings) / name)


def prior_only(settings: PredictorSettings) -> bool:
    """Whether the service runs without an embedder (`ALISE_EMBEDDER=none`)."""
    return settings.embedder.strip().lower() == NO_EMBEDDER


class NullEmbedder(Embedder):
    """The embedder of the prior-only mode: loads nothing; every prompt is the same 1-d zero
    vector (never searched: there is no store, and no MLP reads it)."""

    def __init__(self) -> None:  # Embedder.__init__ loads a model: not called
        self.name, self.dim, self.normalize, self.quantized = NO_EMBEDDER, 1, False, False
        self.max_seq_length, self.batch_size = 0, 0

    def prepare(self, prompts: list[str]) -> list[str]:
        return list(prompts)

    def embed_prepared(self, texts: list[str]) -> np.ndarray:
        return np.zeros((len(texts), self.dim), np.float32)

    @property
    def space(self) -> str:
        return NO_EMBEDDER

    def cache_key(self) -> str:
        return NO_EMBEDDER


def make_embedder(settings: PredictorSettings, normalize: bool = True) -> Embedder:
    if prior_only(settings):
        raise ValueError(
            "ALISE_EMBEDDER=none (prior-only): there is no embedder to seed, train or evaluate "
            "with; set ALISE_EMBEDDER to `all-minilm-l6-v2` or a sentence-transformers dir"
        )
    if settings.predictor_threads:
        import torch

        torch.set_num_threads(settings.predictor_threads)
    return Embedder(
        settings.embedder,
        normalize=normalize,
        max_seq_length=settings.predictor_embed_tokens,
        quantize=settings.predictor_quantize,
    )


def embedding_cache(settings: PredictorSettings, embedder: Embedder) -> EmbeddingCache:
    return EmbeddingCache(embedder, predictor_dir(settings) / "embeddings")


def seed_space(settings: PredictorSettings, embedder: Embedder) -> str:
    """The embedder's space tagged with the seed's source (the fallback regime's calibration
    file), so a store or MLP seeded from ShareGPT's reference lengths, or from an older file,
    is not reused once another file appears (its collections and checkpoints get other names
    and are seeded afresh)."""
    path = regime_file(served_models(settings)[0], Path(settings.data_dir), REGIMES[0])
    return embedder.space if path is None else f"{embedder.space}-{file_tag(path)}"


def regime_suffix(regime: str) -> str:
    """Appended to the model id to key a regime's collection and MLP (the fallback regime
    keeps the names stores had before regimes)."""
    return "" if regime == REGIMES[0] else f".{regime}"


def seeded_regimes(settings: PredictorSettings) -> list[str]:
    """The regimes the service keeps a store and MLP for: the fallback one always (seeded
    from ShareGPT's reference lengths when it has no file), the others when they have a
    calibration file."""
    model, data_dir = served_models(settings)[0], Path(settings.data_dir)
    return [r for r in REGIMES if r == REGIMES[0] or regime_file(model, data_dir, r)]


def load_mlp(settings: PredictorSettings, model: str, space: str = "") -> MlpRegressor | None:
    path = mlp_path(settings, model, space)
    return MlpRegressor.load(path) if path.exists() else None


def regime_mlp_path(settings: PredictorSettings, model: str, regime: str, space: str) -> Path:
    """`ALISE_PREDICTOR_MLP_PATH` names the fallback regime's checkpoint only."""
    if regime == REGIMES[0]:
        return mlp_path(settings, model, space)
    return predictor_dir(settings) / f"mlp-{model}{regime_suffix(regime)}-{space}.pt"


def build_predictors(
    settings: PredictorSettings, embedder: Embedder | None = None, store: LengthStore | None = None
) -> RegimePredictors:
    """One predictor per seeded regime, sharing the embedder, the store and the cache
    (`ALISE_EMBEDDER=none`: `prior_predictors`, whatever `embedder` and `store` are)."""
    if prior_only(settings):
        return prior_predictors()
    embedder = embedder or make_embedder(settings)
    space = seed_space(settings, embedder)
    store = store or open_store(settings, embedder.dim, space)
    model, cache, by_regime = served_models(settings)[0], VectorCache(), {}
    for regime in seeded_regimes(settings):
        path = regime_mlp_path(settings, model, regime, space)
        by_regime[regime] = LengthPredictor(
            embedder,
            store,
            MlpRegressor.load(path) if path.exists() else None,
            k=settings.predictor_top_k,
            s0=settings.predictor_threshold,
            merge_similarity=settings.predictor_merge_similarity,
            capacity=settings.predictor_capacity,
            regime=regime,
            key_suffix=regime_suffix(regime),
            cache=cache,
        )
    return RegimePredictors(by_regime)


def prior_predictors() -> RegimePredictors:
    """Prior-only predictors, one per regime (so a greedy request is no fallback): no
    embedder, store or MLP, so every prediction is `DEFAULT_PRIOR` with source `prior` and
    observations are ignored."""
    log.warning(
        "ALISE_EMBEDDER=none: the predictor runs prior-only (no embedder, store or MLP; no "
        "seeding, observations ignored): every prediction is %.0f tokens, so length-aware "
        "policies order requests by arrival",
        DEFAULT_PRIOR,
    )
    embedder = NullEmbedder()
    return RegimePredictors(
        {r: LengthPredictor(embedder, None, regime=r, key_suffix=regime_suffix(r)) for r in REGIMES}
    )


def build_predictor(
    settings: PredictorSettings, embedder: Embedder | None = None, store: LengthStore | None = None
) -> LengthPredictor:
    """The fallback regime's predictor (temperature 1, the API default; `alise predictor
    seed`, which needs a real embedder: `make_embedder` refuses `ALISE_EMBEDDER=none`)."""
    return build_predictors(settings, embedder or make_embedder(settings), store).primary


def train_samples(settings: PredictorSettings, limit: int | None = None) -> list[Sample]:
    from services.predictor.sharegpt import load_split

    samples = load_split("train", settings.model, settings.data_dir)
    return samples[:limit] if limit else samples


@dataclass
class SeedSet:
    """What a regime's store and MLP learn: per prompt the median length of its draws that
    ended (`samples[i].output_len` rounded, `lengths` exact), the share cut at the cap
    (`capped`, None: reference lengths, no censoring information), the spread of its draws
    (`spread`, NaN with one draw) and how many draws (`count`)."""

    samples: list[Sample]
    lengths: np.ndarray  # [N]
    capped: np.ndarray | None  # [N]
    spread: np.ndarray  # [N]
    count: np.ndarray  # [N]
    source: str

    @classmethod
    def of(cls, samples: list[Sample], censored: np.ndarray | None, source: str) -> SeedSet:
        """One draw per prompt (its length in `output_len`; `censored` flags or None)."""
        n = len(samples)
        lengths = np.array([s.output_len for s in samples], np.float64)
        capped = None if censored is None else np.asarray(censored, np.float64)
        return cls(samples, lengths, capped, np.full(n, np.nan), np.ones(n, np.int64), source)


def regime_seed(
    settings: PredictorSettings, regime: str, limit: int | None = None, path: Path | None = None
) -> SeedSet:
    """The seed of `regime`: its calibration file's prompts (or `path`'s) with the median, cut
    share and spread of their draws; the fallback regime without a file: ShareGPT's reference
    lengths."""
    from services.predictor.regimes import read_draws, summarize_draws

    model = served_models(settings)[0]
    path = path or regime_file(model, Path(settings.data_dir), regime)
    if path is None:
        if regime != REGIMES[0]:
            raise FileNotFoundError(f"no calibration file for {model} in regime {regime}")
        log.warning(
            "no calibration file for %s: seeding from ShareGPT's reference lengths (another "
            "model's answers; predictions will rank poorly). Run `alise predictor calibrate`.",
            model,
        )
        return SeedSet.of(train_samples(settings, limit), None, "reference")
    _, draws = read_draws(path)
    kept = [s for s in train_samples(settings) if s.id in draws][:limit]
    sums = [summarize_draws(draws[s.id]) for s in kept]
    log.info("seeding regime %s from %s (%d prompts)", regime, path, len(kept))
    return SeedSet(
        [replace(s, output_len=max(1, round(d.length))) for s, d in zip(kept, sums)],
        np.array([d.length for d in sums]),
        np.array([d.capped for d in sums]),
        np.array([d.spread if d.count > 1 else np.nan for d in sums]),
        np.array([d.count for d in sums], np.int64),
        str(path),
    )


def seed_samples(
    settings: PredictorSettings, limit: int | None = None
) -> tuple[list[Sample], np.ndarray | None]:
    """(samples, share of cut draws per prompt) of the fallback regime's seed: the served
    model's calibrated lengths when it has a file, else ShareGPT's reference lengths (None)."""
    got = regime_seed(settings, REGIMES[0], limit)
    return got.samples, got.capped


class SeedCancelled(Exception):
    """Seeding stopped on request (what was embedded so far stays cached)."""


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise SeedCancelled()


def embed_samples(
    settings: PredictorSettings,
    embedder: Embedder,
    samples: Sequence[Sample],
    stop: threading.Event | None = None,
) -> np.ndarray:
    """[N, D] embeddings of the samples' prompts, through the on-disk cache."""
    cache = embedding_cache(settings, embedder)
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done == total or done % SAVE_EVERY < EMBED_CHUNK:
            log.info("embedded %d/%d new prompts (%.0f s)", done, total, time.perf_counter() - t0)
        _check(stop)

    return cache.embed([s.prompt for s in samples], progress=progress)


def seed(
    settings: PredictorSettings,
    predictor: LengthPredictor,
    model: str,
    limit: int | None = None,
    stop: threading.Event | None = None,
    samples: list[Sample] | None = None,
    censored: np.ndarray | None = None,
    seed_set: SeedSet | None = None,
) -> dict:
    """Bulk-load `seed_set`, or `samples` (with their `censored` flags; default the
    predictor's regime's seed, `regime_seed`) into `model`'s collection of that regime;
    returns timings."""
    t0 = time.perf_counter()
    got = seed_set or (
        regime_seed(settings, predictor.regime, limit)
        if samples is None
        else SeedSet.of(samples, censored, "given")
    )
    cut = np.zeros(len(got.samples)) if got.capped is None else got.capped
    spread = np.nan_to_num(got.spread)
    vectors = embed_samples(settings, predictor.embedder, got.samples, stop)  # [N, D]
    _check(stop)
    t_embed = time.perf_counter() - t0
    now, key = time.time(), predictor.key(model)
    records = [
        Record(point_id(key, f"seed:{s.id}"), v, float(n), int(c), [f"seed:{s.id}"], now, p, d)
        for s, v, n, c, p, d in zip(got.samples, vectors, got.lengths, got.count, cut, spread)
    ]
    predictor.store.upsert(key, records)
    predictor.store.optimize(key)
    predictor.store.flush()
    return {
        "regime": predictor.regime,
        "source": got.source,
        "points": len(records),
        "draws": int(got.count.sum()),
        "censored": round(float((cut * got.count).sum())),
        "embed_s": round(t_embed, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "store_size": predictor.store.count(key),
    }


def train_mlp(
    settings: PredictorSettings,
    embedder: Embedder,
    model: str,
    limit: int | None = None,
    epochs: int = 60,
    samples: list[Sample] | None = None,
    censored: np.ndarray | None = None,
    regime: str = REGIMES[0],
    seed_set: SeedSet | None = None,
    stop: threading.Event | None = None,
) -> tuple[MlpRegressor, Path]:
    """Fit the MLP of `regime` on `seed_set`, or `samples` (default its `regime_seed`: median
    lengths, cut shares and spreads); save it where the service looks. `stop` set: raises
    SeedCancelled (between embedding chunks or epochs; nothing is saved)."""
    got = seed_set or (
        regime_seed(settings, regime, limit)
        if samples is None
        else SeedSet.of(samples, censored, "given")
    )
    vectors = embed_samples(settings, embedder, got.samples, stop)
    feats = length_feature(embedder.prepare([s.prompt for s in got.samples]))
    lengths = got.lengths.astype(np.float32)
    mlp = train(
        vectors, feats, lengths, epochs=epochs, log=log.info, censored=got.capped,
        spread=got.spread, stop=stop.is_set if stop is not None else None,
    )  # fmt: skip
    _check(stop)
    path = regime_mlp_path(settings, model, regime, seed_space(settings, embedder))
    mlp.save(path)
    return mlp, path


def seed_if_empty(
    settings: PredictorSettings,
    predictors: RegimePredictors,
    stop: threading.Event | None = None,
    empty: set[str] | None = None,
) -> dict | None:
    """Service start-up, per regime: seed an empty collection, and train the MLP when it has
    no checkpoint. `empty`: the regimes whose collection was empty before the service took
    its first Observe (one learned while an earlier regime seeded is still seeded); None:
    look now. Returns the seed reports by regime (None: nothing was seeded)."""
    model = served_models(settings)[0]
    if empty is None:
        empty = predictors.empty(model)
    reports = {}
    for regime, predictor in predictors.by_regime.items():
        if predictor.store is not None and regime in empty:
            reports[regime] = seed(settings, predictor, model, stop=stop)
            log.info("seeded the %s store of regime %s", model, regime, extra=reports[regime])
        if predictor.mlp is None:
            _check(stop)
            predictor.mlp, path = train_mlp(
                settings, predictor.embedder, model, regime=regime, stop=stop
            )
            predictor.prior = predictor.mlp.cfg.prior
            log.info("trained the MLP of regime %s", regime, extra={"path": str(path)})
    return reports or None
