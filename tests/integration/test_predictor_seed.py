"""Seeding: bulk load with the on-disk embedding cache, then the MLP trained from it."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.settings import PredictorSettings
from services.predictor.build import build_predictor, embedding_cache, seed, train_mlp
from services.predictor.sharegpt import Sample

MODEL = "smollm2-135m-instruct"
SAMPLES = [
    Sample(f"id{i}", text, "", 10, n)
    for i, (text, n) in enumerate(
        [
            ("Hi!", 9),
            ("What time is it in Tokyo?", 20),
            ("Write a sonnet about autumn.", 180),
            ("Explain how TCP congestion control works in detail.", 700),
            ("Translate 'thank you' to German.", 8),
            ("Give me a packing list for a ski trip.", 260),
        ]
    )
]


def test_seed_uses_the_embedding_cache_and_trains_the_mlp(tmp_path):
    from services.predictor.embedder import Embedder

    settings = PredictorSettings(data_dir=tmp_path, predictor_seed=False)
    embedder = Embedder()
    predictor = build_predictor(settings, embedder)
    try:
        report = seed(settings, predictor, MODEL, samples=SAMPLES)
        assert report["points"] == report["store_size"] == len(SAMPLES)
        assert len(embedding_cache(settings, embedder)) == len(SAMPLES)
        calls = []
        real = embedder.embed_prepared
        embedder.embed_prepared = lambda texts: calls.append(len(texts)) or real(texts)
        again = seed(settings, predictor, MODEL, samples=SAMPLES)  # same ids: upsert in place
        assert calls == [] and again["store_size"] == len(SAMPLES)
        embedder.embed_prepared = real
        hit = predictor.predict(MODEL, ["Write a sonnet about autumn."])[0]
        assert (hit.source, hit.length) == ("retrieval", 180)
        mlp, path = train_mlp(settings, embedder, MODEL, epochs=5, samples=SAMPLES)
        assert path.exists()
        assert mlp.cfg.prior == pytest.approx(sum(s.output_len for s in SAMPLES) / 6)
    finally:
        predictor.store.close()


def test_seed_prefers_the_served_models_calibration(tmp_path, caplog):
    """With the bundled SmolLM2 calibration the seed is its own lengths with censored flags;
    a model without one falls back to ShareGPT's reference lengths with a warning."""
    from services.common.settings import DEFAULT_DATA_DIR
    from services.predictor.build import seed_samples
    from services.predictor.calibration_files import BUNDLED, read_calibration

    # the tokenized ShareGPT split of the default data directory, which the other tests
    # (test_predictor_calibrate) read: tokenized once per machine, not again here; no
    # calibration file of the data directory (only the bundled one) is seen
    (DEFAULT_DATA_DIR / "traces").mkdir(parents=True, exist_ok=True)
    (tmp_path / "traces").symlink_to(DEFAULT_DATA_DIR / "traces")
    settings = PredictorSettings(data_dir=tmp_path, predictor_seed=False)
    samples, cut = seed_samples(settings)
    _, rows = read_calibration(BUNDLED / "smollm2-135m-instruct-cap256.jsonl")
    assert len(samples) == len(rows) >= 2000 and cut is not None
    assert [s.output_len for s in samples[:50]] == [rows[s.id]["length"] for s in samples[:50]]
    assert cut.tolist() == [rows[s.id]["censored"] for s in samples]
    assert 0.3 < cut.mean() < 0.9  # SmolLM2 often runs to the 256-token cap
    other = PredictorSettings(data_dir=tmp_path, predictor_seed=False, predictor_models=["x"])
    with caplog.at_level("WARNING"):
        ref, none = seed_samples(other, limit=10)
    assert none is None and len(ref) == 10 and "no calibration file for x" in caplog.text


def test_censored_seed_and_observations_give_p_capped(tmp_path):
    from services.predictor.core import Observation
    from services.predictor.embedder import Embedder

    settings = PredictorSettings(data_dir=tmp_path, predictor_seed=False)
    embedder = Embedder()
    predictor = build_predictor(settings, embedder)
    cut = np.array([s.output_len >= 256 for s in SAMPLES])
    try:
        seed(settings, predictor, MODEL, samples=SAMPLES, censored=cut)
        long = predictor.predict(MODEL, ["Explain how TCP congestion control works in detail."])[0]
        assert (long.source, long.p_capped) == ("retrieval", 1.0)
        short = predictor.predict(MODEL, ["Hi!"])[0]
        assert (short.length, short.p_capped) == (9, 0.0)
        # a cut answer merged into "Hi!" does not move its mean, only its capped share
        assert predictor.observe(MODEL, [Observation("r1", "Hi!", 64, censored=True)]) == 1
        again = predictor.predict(MODEL, ["Hi!"])[0]
        assert (again.length, again.p_capped) == (9, 0.5)
    finally:
        predictor.store.close()


def test_a_stop_request_ends_seeding_within_one_chunk(tmp_path):
    """Shutdown during the seed (`alise serve` stopped while the predictor seeds) waits for at
    most one embedding chunk: what was embedded stays cached, nothing reaches the store, and
    no MLP is trained or saved."""
    import threading

    from services.predictor.build import SeedCancelled
    from services.predictor.embedder import EMBED_CHUNK, Embedder

    settings = PredictorSettings(data_dir=tmp_path, predictor_seed=False)
    embedder = Embedder()
    predictor = build_predictor(settings, embedder)
    samples = [Sample(f"s{i}", f"Question number {i}: what is {i} squared?", "", 9, 20 + i)
               for i in range(3 * EMBED_CHUNK)]  # fmt: skip
    stop, calls = threading.Event(), []
    real = embedder.embed_prepared

    def embed_then_stop(texts):
        calls.append(len(texts))
        stop.set()  # asked while the first chunk embeds
        return real(texts)

    embedder.embed_prepared = embed_then_stop
    try:
        with pytest.raises(SeedCancelled):
            seed(settings, predictor, MODEL, samples=samples, stop=stop)
        assert calls == [EMBED_CHUNK]
        assert len(embedding_cache(settings, embedder)) == EMBED_CHUNK
        assert predictor.store.count(predictor.key(MODEL)) == 0
        with pytest.raises(SeedCancelled):
            train_mlp(settings, embedder, MODEL, epochs=5, samples=samples, stop=stop)
        assert calls == [EMBED_CHUNK, EMBED_CHUNK]  # one more chunk, then it stops again
        assert not list(tmp_path.rglob("mlp-*.pt"))
    finally:
        predictor.store.close()
