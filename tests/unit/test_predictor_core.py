"""Algorithm 1's decision rule, prompt normalisation, the MLP and both embedded stores."""

from __future__ import annotations

import numpy as np
import pytest

from services.predictor.core import combine, decide
from services.predictor.embedder import normalize_prompt
from services.predictor.mlp import MlpConfig, MlpRegressor, train
from services.predictor.store_base import Neighbor, Record, collection_name, point_id


def test_combine_weights_by_similarity_and_count_above_threshold():
    nbs = [
        Neighbor("a", 0.9, 100.0, 1),
        Neighbor("b", 0.85, 300.0, 3),
        Neighbor("c", 0.5, 10_000.0, 50),
    ]
    length, used, p_capped = combine(nbs, s0=0.8)
    assert used == 2 and p_capped == 0.0
    assert length == pytest.approx((0.9 * 100 + 0.85 * 3 * 300) / (0.9 + 0.85 * 3))
    assert combine(nbs, s0=0.95) is None


def test_decide_sources():
    hit = decide([Neighbor("a", 0.97, 42.0)], mlp=(500.0, 0.0), prior=200.0, s0=0.8)
    assert (hit.length, hit.source, hit.neighbors) == (42, "retrieval", 1)
    assert hit.similarity == pytest.approx(0.97)
    miss = decide([Neighbor("a", 0.3, 42.0)], mlp=(500.4, 0.25), prior=200.0, s0=0.8)
    assert (miss.length, miss.source, miss.neighbors, miss.p_capped) == (500, "mlp", 0, 0.25)
    assert miss.similarity == pytest.approx(0.3)
    down = decide(None, mlp=(77.0, 0.0), prior=200.0, s0=0.8)
    assert (down.source, down.similarity) == ("mlp", 0.0)
    assert decide(None, None, 123.0, 0.8).source == "prior"


def test_normalize_prompt_extracts_user_turns():
    chatml = (
        "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert normalize_prompt(chatml) == "What is 2+2?"
    llama3 = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert normalize_prompt(llama3) == "Hi there"
    assert normalize_prompt("  plain text ") == "plain text"


def test_collection_and_point_ids_are_stable_and_safe():
    assert collection_name("org/model.v1") == "lengths_org_model_v1"
    # another embedding space is another collection
    assert collection_name("org/model.v1", "3fa9c0d1e2") == "lengths_org_model_v1__3fa9c0d1e2"
    assert collection_name("m", "a") != collection_name("m", "b")
    assert point_id("m", "r1") == point_id("m", "r1") != point_id("m", "r2")
    assert point_id("m", "r1") != point_id("other", "r1")


def test_mlp_learns_and_roundtrips(tmp_path):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((600, 16)).astype(np.float32)
    lengths = np.where(emb[:, 0] > 0, 400.0, 20.0)  # length set by one direction
    feat = rng.random(600).astype(np.float32)
    model = train(emb, feat, lengths, MlpConfig(dim=16, hidden=32), epochs=40, log=None)
    pred = model.predict(emb[:100], feat[:100])
    assert np.mean((pred > 100) == (lengths[:100] > 100)) > 0.9
    assert model.cfg.prior == pytest.approx(lengths.mean())
    model.save(tmp_path / "mlp.pt")
    again = MlpRegressor.load(tmp_path / "mlp.pt")
    np.testing.assert_allclose(again.predict(emb[:5], feat[:5]), pred[:5], rtol=1e-5)


def _unit(rng, n, d=8):
    v = rng.standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(params=["edge", "local"])
def store(request, tmp_path):
    if request.param == "edge":
        from services.predictor.store_edge import EdgeStore

        s = EdgeStore(8, tmp_path / "edge")
    else:
        from services.predictor.store_qdrant import QdrantClientStore

        s = QdrantClientStore(8, path=tmp_path / "local")
    yield s
    s.close()


def test_store_search_payload_update_and_eviction(store):
    rng = np.random.default_rng(1)
    vecs = _unit(rng, 20)
    store.upsert(
        "m",
        [Record(point_id("m", str(i)), v, float(i), time=1000.0 + i) for i, v in enumerate(vecs)],
    )
    assert store.count("m") == 20 and store.count("other") == 0
    top = store.search("m", vecs[[3, 7]], k=3)
    assert [r[0].id for r in top] == [point_id("m", "3"), point_id("m", "7")]
    assert top[0][0].score == pytest.approx(1.0, abs=1e-4) and top[0][0].length == 3.0
    store.upsert("m", [Record(point_id("m", "3"), None, 50.0, 4, ["x"], time=5000.0)])
    again = store.search("m", vecs[3:4], k=1)[0][0]
    assert (again.length, again.count, again.rids) == (50.0, 4, ("x",))
    evicted = store.evict_if_full("m", capacity=10)
    assert evicted == 10 + 0 and store.count("m") == 10
    survivors = {n.id for n in store.search("m", vecs, k=20)[0]}
    assert point_id("m", "3") in survivors  # refreshed by the update
    assert point_id("m", "0") not in survivors  # among the oldest
