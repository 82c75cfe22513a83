"""Logits from the last hidden states: the (often tied) [V, H] output embedding.

On CPU the LM head is the one weight too big for the caches (SmolLM2: 49152 x 576 fp32 =
113 MB), and MKL's sgemm handles it badly for the 1-3 rows of a small decode step: measured
with one thread, 11.4 / 25.9 / 38.5 ms for 1 / 2 / 3 rows, against 5.3 / 10.7 / 15.9 ms for
the same product against a contiguous transposed [H, V] copy. From 4 rows sgemm's packed
kernel wins (18.7 ms against 25.9 ms), so the copy serves only the few-row products. The
decoder layers' weights fit in cache and show no such difference, so only the head gets it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.executor.wquant import PACKED_MAX_ROWS, Int8Weight, quantize_int8

SMALL_ROWS = 3


class LmHead:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        # [H, V] copy for few-row products (fp32 CPU only: what was measured)
        self.transposed = (
            weight.t().contiguous()
            if weight.device.type == "cpu" and weight.dtype == torch.float32
            else None
        )
        # deterministic mode: batch_invariant.make_deterministic's batch-invariant product
        self.product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.packed: Int8Weight | None = None  # INT8 weights (wquant.py: int4/int8 modes)

    def pack(self, dtype: torch.dtype) -> None:
        """Serve few-row products from INT8 weights (per-channel scales); more rows than
        wquant.PACKED_MAX_ROWS still read the full-precision weight (the embedding's, where
        tied)."""
        self.packed, self.transposed = quantize_int8(self.weight, dtype), None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> fp32 logits [S, V]."""
        if self.packed is not None and hidden.shape[0] <= PACKED_MAX_ROWS:
            return self.packed.matmul(hidden.contiguous()).float()
        if self.product is not None:
            return self.product(hidden, self.weight).float()
        if self.transposed is not None and hidden.shape[0] <= SMALL_ROWS:
            return torch.mm(hidden, self.transposed)
        return F.linear(hidden, self.weight).float()
