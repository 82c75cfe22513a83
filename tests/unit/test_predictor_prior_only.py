"""`ALISE_EMBEDDER=none`: the predictor service serves prior-only over real gRPC on loopback,
with no embedder, store, MLP or seed."""

from __future__ import annotations

import logging
import sys

import pytest

from services.common.grpc_client import aio_channel, check_health
from services.common.pb import predictor_pb2, predictor_pb2_grpc
from services.common.settings import PredictorSettings
from services.predictor.build import NullEmbedder, build_predictor, make_embedder, prior_only
from services.predictor.core import DEFAULT_PRIOR
from services.predictor.regimes import REGIMES
from services.predictor.server import start_predictor

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "What is the capital of France?",
    "Write a detailed essay explaining the history of Rome.",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]


def _settings(tmp_path, monkeypatch) -> PredictorSettings:
    monkeypatch.setenv("ALISE_EMBEDDER", "none")  # the variable a user sets
    return PredictorSettings(data_dir=tmp_path, predictor_port=0, predictor_seed=True)


def test_the_setting_selects_prior_only(tmp_path, monkeypatch):
    settings = _settings(tmp_path, monkeypatch)
    assert settings.embedder == "none" and prior_only(settings)
    default = PredictorSettings(data_dir=tmp_path, embedder="all-minilm-l6-v2")
    assert not prior_only(default)
    with pytest.raises(ValueError, match="prior-only"):
        make_embedder(settings)  # seed/train/eval tools get a clear error, not a model load
    with pytest.raises(ValueError, match="prior-only"):
        build_predictor(settings)  # `alise predictor seed`


async def test_prior_only_service_over_grpc(tmp_path, monkeypatch, caplog):
    settings = _settings(tmp_path, monkeypatch)
    already_loaded = "sentence_transformers" in sys.modules  # other tests may have loaded it
    with caplog.at_level(logging.WARNING, logger="services.predictor.build"):
        handle = await start_predictor(settings)
    try:
        assert [r.getMessage() for r in caplog.records if "prior-only" in r.getMessage()]
        assert handle.seeding is None and await handle.wait_seeded() is None  # seed skipped
        assert sorted(handle.predictors.by_regime) == sorted(REGIMES)
        for p in handle.predictors.by_regime.values():
            assert isinstance(p.embedder, NullEmbedder) and p.store is None and p.mlp is None
        if not already_loaded:
            assert "sentence_transformers" not in sys.modules
        assert not (tmp_path / "predictor").exists()  # no store, cache or checkpoint written

        async with aio_channel(f"127.0.0.1:{handle.port}") as channel:
            assert await check_health(channel)
            assert await check_health(channel, "alise.v1.Predictor")
            stub = predictor_pb2_grpc.PredictorStub(channel)
            for temperature in (None, 0.0, 0.7):
                request = predictor_pb2.PredictRequest(model=MODEL, prompts=PROMPTS)
                if temperature is not None:
                    request.temperature = temperature
                reply = await stub.Predict(request)
                got = [(p.length, p.source, p.neighbors) for p in reply.predictions]
                assert got == [(round(DEFAULT_PRIOR), "prior", 0)] * len(PROMPTS)
            obs = predictor_pb2.Observation(request_id="r1", prompt=PROMPTS[0], true_length=7)
            observed = await stub.Observe(
                predictor_pb2.ObserveRequest(model=MODEL, observations=[obs])
            )
            assert observed.accepted == 0  # ignored: nothing to learn into
            await handle.observer.drain()
            after = await stub.Predict(predictor_pb2.PredictRequest(model=MODEL, prompts=PROMPTS))
            assert [p.length for p in after.predictions] == [round(DEFAULT_PRIOR)] * len(PROMPTS)
        metrics = handle.metrics.render().decode()
        assert 'alise:predictor_observations_total{outcome="ignored"} 1.0' in metrics
        assert 'alise:predictor_predictions_total{source="prior"} 12.0' in metrics
    finally:
        await handle.stop()
