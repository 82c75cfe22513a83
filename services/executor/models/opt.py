"""OPT (the ALISE and Sarathi-Serve papers' models): learned positions, LayerNorm, ReLU; its
own runner (services/executor/opt.py)."""

from __future__ import annotations

from services.executor.models.variant import OPT, Family

FAMILY = Family("opt", ("opt",), runner=OPT)
