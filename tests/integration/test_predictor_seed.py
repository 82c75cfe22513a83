"""Seeding: bulk load with the on-disk embedding cache, then the MLP trained from it."""

from __future__ import annotations

import pytest

from services.common.settings import PredictorSettings
from services.predictor.build import build_predictor, embedding_cache, seed, train_mlp
from services.workload.traces.sharegpt import Sample

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
