"""The predictor over real gRPC on loopback: real MiniLM embedder, real Qdrant Edge store.

Stores are seeded with a handful of prompts (not the train split) so the tests stay fast.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from services.common.grpc_client import aio_channel, check_health
from services.common.pb import predictor_pb2, predictor_pb2_grpc
from services.common.settings import PredictorSettings
from services.predictor.build import mlp_path, seed_space
from services.predictor.core import Observation
from services.predictor.mlp import MlpConfig, length_feature, train
from services.predictor.server import start_predictor
from services.predictor.store_base import Record, point_id

MODEL = "smollm2-135m-instruct"
SEEDED = {
    "How do I bake sourdough bread at home? Give me a step by step recipe.": 321,
    "What is the capital of France?": 12,
    "Write a Python function that reverses a linked list.": 140,
    "Summarize the plot of Hamlet in three sentences.": 75,
}
# Prompts with lengths for the tiny MLP: short questions short, "write/explain" long.
MLP_DATA = [(f"What is {w}?", 15) for w in ("red", "a cat", "two plus two", "the time", "pi")] + [
    (f"Write a detailed essay explaining {w}.", 600)
    for w in ("the history of Rome", "quantum computing", "climate change", "the French revolution")
]


def chat(text: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def embedder():
    from services.predictor.embedder import Embedder

    return Embedder()


def _settings(tmp_path, **kw) -> PredictorSettings:
    base = dict(
        data_dir=tmp_path,
        predictor_port=0,
        predictor_seed=False,
        predictor_threshold=0.8,
        predictor_top_k=4,
        predictor_max_prompt_chars=2000,
    )
    return PredictorSettings(**{**base, **kw})


def _train_tiny_mlp(settings, embedder) -> None:
    texts = [t for t, _ in MLP_DATA]
    emb = embedder.embed(texts)
    lengths = np.array([n for _, n in MLP_DATA], np.float32)
    mlp = train(
        emb,
        length_feature(embedder.prepare(texts)),
        lengths,
        MlpConfig(dim=embedder.dim, hidden=32),
        epochs=60,
        val_fraction=0.2,
        log=None,
    )
    mlp.save(mlp_path(settings, MODEL, seed_space(settings, embedder)))


async def _start(settings, embedder, seed=True):
    handle = await start_predictor(settings, embedder=embedder)
    if seed:
        vectors = embedder.embed(list(SEEDED))
        handle.predictor.store.upsert(
            MODEL,
            [
                Record(point_id(MODEL, f"seed{i}"), v, float(n))
                for i, (v, n) in enumerate(zip(vectors, SEEDED.values()))
            ],
        )
    return handle


async def _predict(port, prompts, model=MODEL):
    async with aio_channel(f"127.0.0.1:{port}") as channel:
        stub = predictor_pb2_grpc.PredictorStub(channel)
        reply = await stub.Predict(predictor_pb2.PredictRequest(model=model, prompts=prompts))
    return list(reply.predictions)


async def test_retrieval_mlp_observe_and_restart(tmp_path, embedder):
    settings = _settings(tmp_path)
    _train_tiny_mlp(settings, embedder)
    handle = await _start(settings, embedder)
    try:
        async with aio_channel(f"127.0.0.1:{handle.port}") as channel:
            assert await check_health(channel)
        near = chat("How do I bake sourdough bread at home? Give me a step-by-step recipe")
        far = chat("Translate 'good morning' into Japanese and Korean.")
        hit, miss = await _predict(handle.port, [near, far])
        assert (hit.source, hit.length, hit.neighbors) == ("retrieval", 321, 1)
        assert hit.similarity > 0.9
        assert miss.source == "mlp" and miss.similarity < 0.8 and miss.neighbors == 0

        cricket = "Explain the rules of cricket to a complete beginner."
        before = (await _predict(handle.port, [chat(cricket + " Please.")]))[0]
        assert before.source == "mlp"
        async with aio_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = predictor_pb2_grpc.PredictorStub(channel)
            obs = predictor_pb2.Observation(request_id="r1", prompt=chat(cricket), true_length=900)
            first = await stub.Observe(
                predictor_pb2.ObserveRequest(model=MODEL, observations=[obs])
            )
            again = await stub.Observe(
                predictor_pb2.ObserveRequest(model=MODEL, observations=[obs])
            )
        assert (first.accepted, again.accepted) == (1, 0)
        await handle.observer.drain()
        assert handle.predictor.store.count(MODEL) == len(SEEDED) + 1
        after = (await _predict(handle.port, [chat(cricket + " Please.")]))[0]
        assert (after.source, after.length) == ("retrieval", 900)

        # An identical prompt under a new request id merges into a running mean.
        changed = handle.predictor.observe(MODEL, [Observation("r2", chat(cricket), 500)])
        assert changed == 1 and handle.predictor.store.count(MODEL) == len(SEEDED) + 1
        assert handle.predictor.observe(MODEL, [Observation("r2", chat(cricket), 500)]) == 0
        merged = (await _predict(handle.port, [chat(cricket)]))[0]
        assert merged.length == 700
        metrics = handle.metrics.render().decode()
        assert 'alise:predictor_predictions_total{source="retrieval"}' in metrics
        assert 'alise:predictor_predictions_total{source="mlp"}' in metrics
    finally:
        await handle.stop()

    restarted = await _start(settings, embedder, seed=False)
    try:
        assert restarted.predictor.store.count(MODEL) == len(SEEDED) + 1
        again = (await _predict(restarted.port, [chat(cricket + " Please.")]))[0]
        assert (again.source, again.length) == ("retrieval", 700)
    finally:
        await restarted.stop()


async def _code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


async def test_bad_input_is_invalid_argument(tmp_path, embedder):
    handle = await _start(_settings(tmp_path), embedder, seed=False)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    try:
        async with aio_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = predictor_pb2_grpc.PredictorStub(channel)
            req = predictor_pb2.PredictRequest
            assert await _code_of(stub.Predict(req(model=MODEL, prompts=[]))) == bad
            assert await _code_of(stub.Predict(req(model=MODEL, prompts=["ok", "  "]))) == bad
            assert await _code_of(stub.Predict(req(model=MODEL, prompts=["x" * 2001]))) == bad
            assert await _code_of(stub.Predict(req(model="gpt-9", prompts=["hi"]))) == bad
            obs = predictor_pb2.Observation
            for o in (
                obs(request_id="", prompt="hi", true_length=3),
                obs(request_id="a", prompt="hi", true_length=-1),
                obs(request_id="a", prompt="", true_length=3),
            ):
                call = stub.Observe(predictor_pb2.ObserveRequest(model=MODEL, observations=[o]))
                assert await _code_of(call) == bad
            raw = channel.unary_unary(
                "/alise.v1.Predictor/Predict",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            assert await _code_of(raw(b"\x0a\xff\xff\xff")) == bad  # truncated field
            ok = await stub.Predict(req(model=MODEL, prompts=["hello"]))
            assert ok.predictions[0].source == "prior"  # no MLP, empty store
    finally:
        await handle.stop()


async def test_unreachable_store_falls_back_to_mlp(tmp_path, embedder):
    settings = _settings(tmp_path, qdrant_url="http://127.0.0.1:9")  # discard port: refused
    _train_tiny_mlp(settings, embedder)
    handle = await start_predictor(settings, embedder=embedder)
    try:
        preds = await _predict(handle.port, [chat("What is the capital of France?")])
        assert preds[0].source == "mlp" and preds[0].similarity == 0.0 and preds[0].length >= 1
    finally:
        await handle.stop()


async def test_the_service_gives_free_heap_back_while_it_serves(tmp_path, embedder):
    from services.common import heap

    if not heap.available():
        pytest.skip("malloc_trim is glibc's")
    handle = await _start(_settings(tmp_path, predictor_trim_s=0.05), embedder)
    try:
        for _ in range(500):  # the periodic trims run on their own (no time bound asserted)
            if handle.trimmer.trims >= 2:
                break
            await asyncio.sleep(0.02)
        assert handle.trimmer.trims >= 2
        hit = (await _predict(handle.port, [chat("What is the capital of France?")]))[0]
        assert (hit.source, hit.length) == ("retrieval", 12)
        rendered = handle.metrics.render().decode().splitlines()
        counts = [
            line for line in rendered if line.startswith("alise:predictor_heap_trim_seconds_count")
        ]
        assert float(counts[0].split()[1]) >= 2
    finally:
        await handle.stop()
    off = await _start(_settings(tmp_path / "off", predictor_trim_s=0), embedder, seed=False)
    try:
        assert not off.trimmer.enabled and await off.trimmer.now() is None
    finally:
        await off.stop()


def test_cached_embeddings_hold_only_their_own_vector(tmp_path, embedder):
    """A prompt's embedding kept for Observe owns its 1.5 KB: no view of the batch it came in,
    nor of the model's output tensor behind that (~3 KB more per cached prompt, which the
    soak saw as anonymous memory rising until the cache's 4,096 entries were full)."""
    from services.predictor.core import LengthPredictor
    from services.predictor.embedder import text_hash

    predictor = LengthPredictor(embedder, None, None)
    prompts = ["Tell me about the sea (1).", "Tell me about bees (2).", "Name a volcano."]
    vectors, _ = predictor.embed(prompts)
    for text, row in zip(embedder.prepare(prompts), vectors, strict=True):
        kept = predictor.cache.get(text_hash(text))
        assert kept is not None and kept.base is None and kept.flags["OWNDATA"]
        assert kept.nbytes == embedder.dim * 4 and np.array_equal(kept, row)
    assert embedder.embed(prompts).base is None  # the embedder's own result: no tensor behind


async def test_the_service_compacts_its_store_while_it_learns(tmp_path, embedder, monkeypatch):
    """New prompts past the capacity evict the oldest points; the embedded store then compacts
    itself (counted in the metric) and goes on answering from what it holds."""
    from services.predictor import store_edge

    monkeypatch.setattr(store_edge, "COMPACT_MIN_DEAD", 8)
    handle = await _start(_settings(tmp_path, predictor_capacity=16), embedder, seed=False)
    try:
        async with aio_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = predictor_pb2_grpc.PredictorStub(channel)
            for i in range(60):
                topic = ("rivers", "bread", "chess", "bees")[i % 4]
                obs = predictor_pb2.Observation(
                    request_id=f"r{i}", prompt=chat(f"Tell me about {topic}, part {i}."),
                    true_length=10 + i,
                )  # fmt: skip
                await stub.Observe(predictor_pb2.ObserveRequest(model=MODEL, observations=[obs]))
        await handle.observer.drain()
        store = handle.predictor.store
        assert store.compactions >= 1
        assert 15 <= store.count(MODEL) <= 16
        rendered = handle.metrics.render().decode().splitlines()
        gauge = [line for line in rendered if line.startswith("alise:predictor_store_compactions")]
        assert float(gauge[0].split()[1]) == store.compactions
        last = (await _predict(handle.port, [chat("Tell me about bees, part 59.")]))[0]
        assert last.source == "retrieval"
        assert 10 + 60 - 16 <= last.length <= 10 + 59  # from the 16 newest points only
    finally:
        await handle.stop()
