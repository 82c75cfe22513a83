"""Open the length store the settings ask for (the interface is in store_base.py).

Backends (same interface):
- `QdrantClientStore` (store_qdrant.py): qdrant-client against a server (`ALISE_QDRANT_URL`),
  or its local mode (`path=`), which searches by brute force;
- `EdgeStore` (store_edge.py): Qdrant Edge, an in-process engine with an HNSW index.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.predictor.store_base import LengthStore

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings


def open_store(settings: PredictorSettings, dim: int, space: str = "") -> LengthStore:
    """The backend the settings ask for: server when `qdrant_url` is set, else embedded;
    its collections are those of embedding space `space`."""
    store = _open_backend(settings, dim)
    store.space = space
    return store


def _open_backend(settings: PredictorSettings, dim: int) -> LengthStore:
    if settings.qdrant_url:
        from services.predictor.store_qdrant import QdrantClientStore

        return QdrantClientStore(dim, url=settings.qdrant_url, api_key=settings.qdrant_api_key)
    root = Path(settings.data_dir) / "predictor"
    if settings.predictor_store == "local":
        from services.predictor.store_qdrant import QdrantClientStore

        return QdrantClientStore(dim, path=root / "qdrant-local")
    from services.predictor.store_edge import EdgeStore

    return EdgeStore(dim, root / "qdrant-edge")
