"""Models for the GPU tests: the bundled SmolLM2-135M-Instruct and tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.executor.tiny import ARCHS, NEW_FAMILIES, make_tiny_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from services.common.models import weights_dir
    from services.common.settings import ExecutorSettings

    settings = ExecutorSettings()
    return weights_dir(settings.model, settings.data_dir)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gpu")
    return {arch: make_tiny_model(root / arch, arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def model_dirs(smollm2_dir, tiny_dirs) -> dict[str, Path]:
    return {"smollm2": smollm2_dir, **{f"tiny-{a}": d for a, d in tiny_dirs.items()}}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """The registry's newer families (windows, soft-caps, QK-norm, partial rotary), 64-wide
    heads."""
    root = tmp_path_factory.mktemp("families-gpu")
    return {a: make_tiny_model(root / a, a, seed=1, head_dim=64) for a in NEW_FAMILIES}
