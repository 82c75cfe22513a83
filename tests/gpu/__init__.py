"""Tests that need a CUDA device: `pytest -m gpu` (`make test-gpu`). Every module here carries
GPU_ONLY, so without CUDA they are collected and skipped with the reason."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
