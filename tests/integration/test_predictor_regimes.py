"""Per-temperature-regime stores over real gRPC (real MiniLM, real Qdrant Edge): each regime
seeded from its own calibration file with several draws per prompt; a regime without a file is
answered by `t1`, labelled. The files here hold a handful of train-split prompts, so the
seed stays fast."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.common.grpc_client import aio_channel
from services.common.pb import predictor_pb2, predictor_pb2_grpc
from services.common.settings import CommonSettings, PredictorSettings
from services.predictor.build import regime_seed, seed
from services.predictor.server import start_predictor

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def embedder():
    from services.predictor.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="module")
def prompts():
    """Four train-split samples (ids and prompts)."""
    from services.predictor.sharegpt import load_split

    return load_split("train", MODEL)[:4]


def _data_dir(tmp_path: Path, files: dict[str, list[dict]]) -> Path:
    """A data dir with these calibration files, sharing the tokenized ShareGPT cache."""
    cached = CommonSettings().data_dir / "traces"
    if cached.exists():
        os.symlink(cached, tmp_path / "traces")
    (tmp_path / "calibration").mkdir()
    for name, rows in files.items():
        lines = [{"header": {"model": MODEL, "max_tokens": 256}}, *rows]
        (tmp_path / "calibration" / name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    return tmp_path


def _row(sample, lengths, cut=None) -> dict:
    return {"id": sample.id, "prompt_len": 1, "lengths": lengths,
            "censored": cut or [False] * len(lengths)}  # fmt: skip


async def _predict(port: int, prompt: str, temperature: float | None) -> predictor_pb2.Prediction:
    async with aio_channel(f"127.0.0.1:{port}") as channel:
        stub = predictor_pb2_grpc.PredictorStub(channel)
        request = predictor_pb2.PredictRequest(model=MODEL, prompts=[prompt])
        if temperature is not None:
            request.temperature = temperature
        return (await stub.Predict(request)).predictions[0]


async def test_each_regime_answers_from_its_own_draws(tmp_path, embedder, prompts):
    a, b, c, d = prompts
    data_dir = _data_dir(
        tmp_path,
        {
            f"{MODEL}-cap256-t1.jsonl": [
                _row(a, [40, 10, 256, 20], [False, False, True, False]),
                _row(b, [200, 210, 190, 206]),
                _row(c, [256, 256, 256, 30], [True, True, True, False]),
            ],
            f"{MODEL}-cap256-t0.jsonl": [_row(a, [300]), _row(b, [12]), _row(d, [256], [True])],
        },
    )
    settings = PredictorSettings(data_dir=data_dir, predictor_port=0, predictor_seed=False)
    t1 = regime_seed(settings, "t1")
    assert [s.id for s in t1.samples] == [a.id, b.id, c.id]
    assert t1.lengths.tolist() == [20.0, 203.0, 30.0] and t1.capped.tolist() == [0.25, 0, 0.75]
    assert t1.count.tolist() == [4, 4, 4] and t1.spread[0] > t1.spread[1] > 0
    handle = await start_predictor(settings, embedder=embedder)
    try:
        assert sorted(handle.predictors.by_regime) == ["t0", "t1"]
        for regime, predictor in handle.predictors.by_regime.items():
            report = seed(settings, predictor, MODEL)
            assert report["regime"] == regime and report["points"] == 3
        assert handle.predictors.count(MODEL) == {"t1": 3, "t0": 3}
        sampled = await _predict(handle.port, a.prompt, None)  # not sent: temperature 1
        assert (sampled.source, sampled.regime, sampled.length) == ("retrieval", "t1", 20)
        assert sampled.p_capped == pytest.approx(0.25) and sampled.spread > 0.5
        greedy = await _predict(handle.port, a.prompt, 0.0)
        assert (greedy.source, greedy.regime, greedy.length) == ("retrieval", "t0", 300)
        assert (greedy.p_capped, greedy.spread) == (0.0, 0.0)  # one draw: spread unknown
        assert (await _predict(handle.port, b.prompt, 0.7)).length == 203
        # an observation at temperature 0 teaches the t0 collection only
        async with aio_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = predictor_pb2_grpc.PredictorStub(channel)
            obs = predictor_pb2.Observation(request_id="r1", prompt="Hello there!", true_length=9)
            await stub.Observe(
                predictor_pb2.ObserveRequest(model=MODEL, observations=[obs], temperature=0.0)
            )
        await handle.observer.drain()
        assert handle.predictors.count(MODEL) == {"t1": 3, "t0": 4}
    finally:
        await handle.stop()


async def test_a_regime_without_a_file_falls_back_to_t1_labelled(
    tmp_path, embedder, prompts, caplog, monkeypatch
):
    from services.predictor import calibration_files

    # a model whose package bundles no greedy file (SmolLM2's t0 file in draws/ set aside)
    monkeypatch.setattr(calibration_files, "DRAWS", tmp_path / "no-bundled-draws")
    a = prompts[0]
    data_dir = _data_dir(tmp_path, {f"{MODEL}-cap256-t1.jsonl": [_row(a, [40, 50, 60])]})
    settings = PredictorSettings(data_dir=data_dir, predictor_port=0, predictor_seed=False)
    handle = await start_predictor(settings, embedder=embedder)
    try:
        assert sorted(handle.predictors.by_regime) == ["t1"]
        seed(settings, handle.predictor, MODEL)
        with caplog.at_level("WARNING"):
            greedy = await _predict(handle.port, a.prompt, 0.0)
        assert (greedy.source, greedy.regime, greedy.length) == ("retrieval@t1", "t1", 50)
        assert "no calibration file for temperature regime t0" in caplog.text
        sampled = await _predict(handle.port, a.prompt, 1.0)
        assert (sampled.source, sampled.regime) == ("retrieval", "t1")
        metrics = handle.metrics.render().decode()
        assert 'alise:predictor_predictions_total{source="retrieval@t1"}' in metrics
    finally:
        await handle.stop()


async def test_a_regime_that_learns_before_its_seed_is_still_seeded(
    tmp_path, embedder, prompts, monkeypatch
):
    """The service seeds its regimes one after the other while it already answers: a greedy
    request finished during the first regime's seed must not make the second one look seeded."""
    from services.predictor import build
    from services.predictor.core import Observation

    a, b, c, _ = prompts
    data_dir = _data_dir(
        tmp_path,
        {
            f"{MODEL}-cap256-t1.jsonl": [_row(a, [40, 50, 60]), _row(b, [200, 210, 190])],
            f"{MODEL}-cap256-t0.jsonl": [_row(a, [300]), _row(b, [12]), _row(c, [256], [True])],
        },
    )
    settings = PredictorSettings(data_dir=data_dir, predictor_port=0, predictor_seed=True)
    real_seed, learned = build.seed, []

    def seed_after_a_request(settings, predictor, model, **kw):
        if not learned:  # the first regime's seed: a request of the other regime ends meanwhile
            other = next(p for p in handle.predictors.by_regime.values() if p is not predictor)
            assert other.observe(model, [Observation("early", "Hello there!", 9)]) == 1
            learned.append(other.regime)
        return real_seed(settings, predictor, model, **kw)

    monkeypatch.setattr(build, "seed", seed_after_a_request)
    handle = await start_predictor(settings, embedder=embedder)
    try:
        reports = await handle.wait_seeded()
        assert len(learned) == 1 and sorted(reports) == ["t0", "t1"]
        seeded = {"t1": 2, "t0": 3}
        seeded[learned[0]] += 1  # its seed and the request it learned first
        assert handle.predictors.count(MODEL) == seeded
    finally:
        await handle.stop()
