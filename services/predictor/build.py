"""Assemble a predictor from settings; seed its store and train its MLP.

Seeding bulk-loads prompts of the train split of `services.workload.traces.sharegpt` (the
fixed split the simulator uses too) with output lengths. When the served model has a
calibration file (`alise predictor calibrate`: its own answers' lengths at one cap, with
censored flags; one is bundled for SmolLM2) those prompts and lengths are the seed, and the
MLP learns P(runs to the cap) too. Otherwise the seed is ShareGPT's reference lengths (another
model's answers), with a warning. The prompts' embeddings are cached on disk
(`<data_dir>/predictor/embeddings/`, keyed by embedder and text hash), so only the first seed
pays for embedding them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.common.settings import PredictorSettings
from services.predictor.core import LengthPredictor
from services.predictor.embedder import Embedder, EmbeddingCache
from services.predictor.mlp import MlpRegressor, length_feature, train
from services.predictor.store import open_store
from services.predictor.store_base import LengthStore, Record, point_id

if TYPE_CHECKING:
    from services.workload.traces.sharegpt import Sample

log = logging.getLogger(__name__)


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


def make_embedder(settings: PredictorSettings, normalize: bool = True) -> Embedder:
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
    """The embedder's space tagged with the seed's source, so a store or MLP seeded from
    ShareGPT's reference lengths is not reused once the served model has a calibration file
    (its collection and checkpoint get another name and are seeded afresh)."""
    from services.predictor.calibration_files import DEFAULT_CAP, calibration_file

    path = calibration_file(served_models(settings)[0], Path(settings.data_dir))
    return embedder.space if path is None else f"{embedder.space}-cal{DEFAULT_CAP}"


def load_mlp(settings: PredictorSettings, model: str, space: str = "") -> MlpRegressor | None:
    path = mlp_path(settings, model, space)
    return MlpRegressor.load(path) if path.exists() else None


def build_predictor(
    settings: PredictorSettings, embedder: Embedder | None = None, store: LengthStore | None = None
) -> LengthPredictor:
    embedder = embedder or make_embedder(settings)
    space = seed_space(settings, embedder)
    store = store or open_store(settings, embedder.dim, space)
    mlp = load_mlp(settings, served_models(settings)[0], space)
    return LengthPredictor(
        embedder,
        store,
        mlp,
        k=settings.predictor_top_k,
        s0=settings.predictor_threshold,
        merge_similarity=settings.predictor_merge_similarity,
        capacity=settings.predictor_capacity,
    )


def train_samples(settings: PredictorSettings, limit: int | None = None) -> list[Sample]:
    from services.workload.traces.sharegpt import load_split

    samples = load_split("train", settings.model, settings.data_dir)
    return samples[:limit] if limit else samples


def seed_samples(
    settings: PredictorSettings, limit: int | None = None
) -> tuple[list[Sample], np.ndarray | None]:
    """(samples, censored flags) to seed from: the served model's calibrated lengths when a
    calibration file exists, else ShareGPT's reference lengths (flags None)."""
    from services.predictor.calibration_files import (
        calibrated_samples,
        calibration_file,
        read_calibration,
    )

    model = served_models(settings)[0]
    path = calibration_file(model, Path(settings.data_dir))
    if path is None:
        log.warning(
            "no calibration file for %s: seeding from ShareGPT's reference lengths (another "
            "model's answers; predictions will rank poorly). Run `alise predictor calibrate`.",
            model,
        )
        return train_samples(settings, limit), None
    _, rows = read_calibration(path)
    samples = calibrated_samples(train_samples(settings), rows)[:limit]
    log.info("seeding from the calibration file %s (%d prompts)", path, len(samples))
    return samples, np.array([bool(rows[s.id]["censored"]) for s in samples], bool)


class SeedCancelled(Exception):
    """Seeding stopped on request (what was embedded so far stays cached)."""


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
        log.info("embedded %d/%d new prompts (%.0f s)", done, total, time.perf_counter() - t0)
        if stop is not None and stop.is_set():
            raise SeedCancelled()

    return cache.embed([s.prompt for s in samples], progress=progress)


def seed(
    settings: PredictorSettings,
    predictor: LengthPredictor,
    model: str,
    limit: int | None = None,
    stop: threading.Event | None = None,
    samples: list[Sample] | None = None,
    censored: np.ndarray | None = None,
) -> dict:
    """Bulk-load `samples` (default `seed_samples`) into `model`'s collection; returns
    timings."""
    t0 = time.perf_counter()
    if samples is None:
        samples, censored = seed_samples(settings, limit)
    cut = np.zeros(len(samples)) if censored is None else censored.astype(np.float64)
    vectors = embed_samples(settings, predictor.embedder, samples, stop)  # [N, D]
    t_embed = time.perf_counter() - t0
    now = time.time()
    records = [
        Record(point_id(model, f"seed:{s.id}"), v, float(s.output_len), 1, [f"seed:{s.id}"], now, c)
        for s, v, c in zip(samples, vectors, cut)
    ]
    predictor.store.upsert(model, records)
    predictor.store.optimize(model)
    predictor.store.flush()
    return {
        "points": len(records),
        "censored": int(cut.sum()),
        "embed_s": round(t_embed, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "store_size": predictor.store.count(model),
    }


def train_mlp(
    settings: PredictorSettings,
    embedder: Embedder,
    model: str,
    limit: int | None = None,
    epochs: int = 60,
    samples: list[Sample] | None = None,
    censored: np.ndarray | None = None,
) -> tuple[MlpRegressor, Path]:
    """Fit the MLP on `samples` (default `seed_samples`); save it where the service looks."""
    if samples is None:
        samples, censored = seed_samples(settings, limit)
    vectors = embed_samples(settings, embedder, samples)
    feats = length_feature(embedder.prepare([s.prompt for s in samples]))
    lengths = np.array([s.output_len for s in samples], np.float32)
    mlp = train(vectors, feats, lengths, epochs=epochs, log=log.info, censored=censored)
    path = mlp_path(settings, model, seed_space(settings, embedder))
    mlp.save(path)
    return mlp, path


def seed_if_empty(
    settings: PredictorSettings, predictor: LengthPredictor, stop: threading.Event | None = None
) -> dict | None:
    """Service start-up: seed an empty store, and train the MLP when it has no checkpoint."""
    model = served_models(settings)[0]
    report = None
    if predictor.store is not None and predictor.store.count(model) == 0:
        report = seed(settings, predictor, model, stop=stop)
        log.info("seeded the %s store", model, extra=report)
    if predictor.mlp is None:
        predictor.mlp, path = train_mlp(settings, predictor.embedder, model)
        predictor.prior = predictor.mlp.cfg.prior
        log.info("trained the MLP fallback", extra={"path": str(path)})
    return report
