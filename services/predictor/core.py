"""ALISE Algorithm 1: retrieval-based length prediction with an MLP fallback, plus learning.

predict: embed each prompt; search the model's collection for the top-k neighbours; if the
best similarity is below s0 (or the store is unreachable) the MLP predicts from the embedding,
otherwise the result is the mean of the lengths of the neighbours at or above s0, weighted by
similarity x merged count. With no MLP either, the prior (train mean) is returned.

Censored lengths (answers cut by max_tokens, `services.common.censoring`): each prediction
also carries `p_capped`, the probability that the answer runs to the cap, and `length` is then
the expected length of the answers that end on their own. Retrieval weighs the neighbours'
censored shares; the MLP has a second head for it.

observe: embed; the nearest point at or above `merge_similarity` absorbs the true length into
its running mean, otherwise a new point is added (id derived from the request id); past
capacity the oldest points go. A request id already merged or stored is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from services.common.censoring import merge_censored
from services.predictor.embedder import Embedder, text_hash
from services.predictor.mlp import MlpRegressor, length_feature
from services.predictor.store_base import LengthStore, Neighbor, Record, StoreUnavailable, point_id

log = logging.getLogger(__name__)
DEFAULT_PRIOR = 200.0  # tokens; used only when no MLP checkpoint carries the train mean


@dataclass(frozen=True)
class Prediction:
    length: int
    source: str  # "retrieval" | "mlp" | "prior"
    similarity: float  # best neighbour similarity, 0 when the store was not searched
    neighbors: int  # neighbours averaged (retrieval), else 0
    p_capped: float = 0.0  # probability of running to the cap (0: no censoring information)
    spread: float = 0.0  # std of log1p(length) over the prompt's draws (0: unknown)
    regime: str = ""  # the temperature regime whose store and MLP answered ("t1" | "t0")


@dataclass(frozen=True)
class Observation:
    request_id: str
    prompt: str
    true_length: int
    censored: bool = False  # cut by max_tokens: true_length is a lower bound


def combine(neighbors: list[Neighbor], s0: float) -> tuple[float, int, float] | None:
    """(length, neighbours used, p_capped) from the neighbours at or above s0, weighted by
    similarity x count (None: none are). `length` averages the uncensored part of each
    neighbour; when every neighbour was censored it is their weighted lower bound."""
    used = [n for n in neighbors if n.score >= s0]
    if not used:
        return None
    w = np.array([max(n.score, 1e-6) * n.count for n in used])
    capped = np.array([n.capped for n in used])
    lengths = np.array([n.length for n in used])
    p = float(np.dot(w, capped) / w.sum())
    w_eos = w * (1.0 - capped)
    if w_eos.sum() <= 1e-9:
        return float(np.dot(w, lengths) / w.sum()), len(used), p
    return float(np.dot(w_eos, lengths) / w_eos.sum()), len(used), p


def combine_spread(neighbors: list[Neighbor], s0: float) -> float:
    """The similarity x count weighted spread of the neighbours at or above s0 that know
    theirs (0: none does)."""
    used = [n for n in neighbors if n.score >= s0 and n.spread > 0]
    if not used:
        return 0.0
    w = np.array([max(n.score, 1e-6) * n.count for n in used])
    return float(np.dot(w, [n.spread for n in used]) / w.sum())


def decide(
    neighbors: list[Neighbor] | None, mlp: tuple[float, ...] | None, prior: float, s0: float
) -> Prediction:
    """One prompt's prediction from its neighbours (None: store not searched) and the MLP's
    (length, p_capped[, spread])."""
    best = neighbors[0].score if neighbors else 0.0
    hit = combine(neighbors, s0) if neighbors else None
    if hit is not None:
        spread = combine_spread(neighbors or [], s0)
        return Prediction(max(1, round(hit[0])), "retrieval", best, hit[1], hit[2], spread)
    if mlp is not None:
        spread = mlp[2] if len(mlp) > 2 else 0.0
        return Prediction(max(1, round(mlp[0])), "mlp", best, 0, mlp[1], spread)
    return Prediction(max(1, round(prior)), "prior", best, 0)


class VectorCache:
    """Recent prompt embeddings by text hash, so Observe reuses what Predict computed."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._data: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            v = self._data.get(key)
            if v is not None:
                self._data.move_to_end(key)
            return v

    def put(self, key: str, vector: np.ndarray) -> None:
        with self._lock:
            self._data[key] = vector
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)


class LengthPredictor:
    def __init__(
        self,
        embedder: Embedder,
        store: LengthStore | None,
        mlp: MlpRegressor | None = None,
        prior: float | None = None,
        k: int = 8,
        s0: float = 0.8,
        merge_similarity: float = 0.98,
        capacity: int = 200_000,
        regime: str = "t1",
        key_suffix: str = "",
        cache: VectorCache | None = None,
    ) -> None:
        """`regime` labels the predictions; `key_suffix` is appended to the model id to name
        this regime's collection (regimes share one store, `cache` shares embeddings)."""
        self.embedder, self.store, self.mlp = embedder, store, mlp
        self.regime, self.key_suffix = regime, key_suffix
        self.prior = (
            prior
            if prior is not None
            else (mlp.cfg.prior if mlp is not None and mlp.cfg.prior > 0 else DEFAULT_PRIOR)
        )
        self.k, self.s0 = k, s0
        self.merge_similarity, self.capacity = merge_similarity, capacity
        self.cache = cache or VectorCache()
        self._write_lock = threading.Lock()  # one observe batch at a time (merge = read+write)

    def embed(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """([N, D] unit embeddings, [N] length feature), reusing cached rows."""
        texts = self.embedder.prepare(list(prompts))
        keys = [text_hash(t) for t in texts]
        rows = [self.cache.get(k) for k in keys]
        missing = [i for i, r in enumerate(rows) if r is None]
        if missing:
            fresh = self.embedder.embed_prepared([texts[i] for i in missing])  # [M, D]
            for i, v in zip(missing, fresh):
                rows[i] = v
                self.cache.put(keys[i], v.copy())  # its own 1.5 KB, not a view of the batch
        vectors = np.stack(rows) if rows else np.zeros((0, self.embedder.dim), np.float32)
        return vectors, length_feature(texts)

    def key(self, model: str) -> str:
        """The store key (collection) of `model` in this regime."""
        return model + self.key_suffix

    def search(self, model: str, vectors: np.ndarray) -> list[list[Neighbor]] | None:
        """Top-k per row, or None when there is no store or it cannot be reached."""
        if self.store is None:
            return None
        try:
            return self.store.search(self.key(model), vectors, self.k)
        except StoreUnavailable as exc:
            log.warning("store unreachable, falling back to the MLP: %s", exc)
            return None

    def mlp_lengths(
        self, vectors: np.ndarray, feats: np.ndarray
    ) -> list[tuple[float, float, float] | None]:
        """The MLP's (length, p_capped, spread) per row (None without an MLP)."""
        if self.mlp is None:
            return [None] * len(vectors)
        lengths = self.mlp.predict(vectors, feats)
        capped = self.mlp.predict_capped(vectors, feats)
        spread = self.mlp.predict_spread(vectors, feats)
        return [(float(n), float(p), float(v)) for n, p, v in zip(lengths, capped, spread)]

    def predict(self, model: str, prompts: Sequence[str]) -> list[Prediction]:
        vectors, feats = self.embed(prompts)
        found = self.search(model, vectors)
        neighbors = found if found is not None else [None] * len(prompts)
        need_mlp = [n is None or combine(n, self.s0) is None for n in neighbors]
        mlp: list[tuple[float, float, float] | None] = [None] * len(prompts)
        if any(need_mlp):
            idx = [i for i, need in enumerate(need_mlp) if need]
            for i, value in zip(idx, self.mlp_lengths(vectors[idx], feats[idx])):
                mlp[i] = value
        return [
            replace(decide(n, m, self.prior, self.s0), regime=self.regime)
            for n, m in zip(neighbors, mlp)
        ]

    def observe(self, model: str, observations: Sequence[Observation]) -> int:
        """Teach the store; returns how many observations changed it (duplicates do not)."""
        if self.store is None or not observations:
            return 0
        vectors, _ = self.embed([o.prompt for o in observations])
        changed, key = 0, self.key(model)
        with self._write_lock:  # search-then-write per observation: merges see earlier ones
            for obs, vector in zip(observations, vectors):
                nearest = self.store.search(key, vector[None], 1)[0]
                changed += self._absorb(key, obs, vector, nearest[0] if nearest else None)
            if changed:
                self.store.evict_if_full(key, self.capacity)
        return changed

    def _absorb(
        self, model: str, obs: Observation, vector: np.ndarray, near: Neighbor | None
    ) -> bool:
        pid = point_id(model, obs.request_id)
        if near is not None and (near.id == pid or obs.request_id in near.rids):
            return False  # this request id is already in the store
        if near is not None and near.score >= self.merge_similarity:
            length, count, capped = merge_censored(
                near.length, near.count, near.capped, obs.true_length, obs.censored
            )
            rids = [*near.rids, obs.request_id]
            rec = Record(near.id, None, length, count, rids, time.time(), capped, near.spread)
        else:
            rec = Record(
                pid,
                vector,
                float(obs.true_length),
                1,
                [obs.request_id],
                time.time(),
                float(obs.censored),
            )
        self.store.upsert(model, [rec])
        return True
