"""Compiled CPU kernels (csrc/): paged decode attention read straight from the KV pool, full
precision and INT8 (paged_decode.cpp), and the MLP's SiLU-and-multiply (activation.cpp).

Built at run time with torch's extension builder (a C++ compiler and ninja, both in the
executor image and `make setup`), once per machine: the build is cached under
`TORCH_EXTENSIONS_DIR` (default ~/.cache/torch_extensions) in a directory named after this
CPU's feature flags, since it is compiled for the CPU it runs on (-march=native). The first
build takes ~25 s on a 2-core machine; later loads take well under a second. Where the build
fails (no compiler), `load()` logs why once and returns False: the executor then uses the
torch attention (attention.py), which computes the same thing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from services.executor.config import cpu_flags

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name("csrc") / name for name in ("paged_decode.cpp", "activation.cpp")
]
# -march=native: the build is for this CPU (the cache directory is named after its flags).
# -ffast-math: the kernels never meet an infinity or a NaN (softmax starts from a real score),
# and it lets the sums reassociate and exp() use glibc's vector versions. -fopenmp: torch's
# parallel_for runs on torch's own OpenMP threads (the same libgomp).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def build_name() -> str:
    """The extension's name: one per CPU model's flags and torch version."""
    key = " ".join(sorted(cpu_flags())) + torch.__version__ + " ".join(CFLAGS)
    return "alise_cpu_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def _ensure_ninja_on_path() -> None:
    """torch's builder runs `ninja`; the pip package installs it next to this interpreter,
    which is not on PATH when the executor is started by absolute path."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def load() -> bool:
    """Build (first time on this machine) and load the kernels; False, logged once, where
    they cannot be built. Thread-safe; later calls return the first answer."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
        return _loaded


def disabled() -> bool:
    """ALISE_CPU_KERNELS=off (or 0, false): never build them, use the torch attention."""
    return os.environ.get("ALISE_CPU_KERNELS", "").lower() in ("0", "false", "off")


def _build() -> bool:
    if disabled():
        log.info("compiled CPU kernels off (ALISE_CPU_KERNELS): torch attention")
        return False
    try:
        from torch.utils.cpp_extension import load as load_extension

        _ensure_ninja_on_path()
        load_extension(
            build_name(),
            sources=[str(p) for p in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a failed build: all mean "use torch"
        reason = " ".join(str(exc).split())[:300]
        log.warning("compiled CPU kernels unavailable, using torch attention: %s", reason)
        return False
    return True


def loaded() -> bool:
    """Whether the kernels are loaded in this process (never builds them)."""
    return bool(_loaded)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for the fused gate/up output [T, 2I]: one op on CPU once the
    kernels are loaded, torch's two elsewhere."""
    if _loaded and x.device.type == "cpu" and x.is_contiguous():
        return torch.ops.alise_cpu.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D] (one query per request) against the paged pools [Hkv, NB, bs, D] of one
    layer, request b reading its first lens[b] keys through tables[b] -> [B, H, D]."""
    return torch.ops.alise_cpu.paged_decode(q, k_pool, v_pool, tables, lens, scale)


def paged_decode_int8(
    q: torch.Tensor,
    pools: dict[str, torch.Tensor],
    k_stage: torch.Tensor,
    v_stage: torch.Tensor,
    tables: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """As paged_decode over one layer of an INT8 pool (`pools`: kq ks ko vq vs vo, see
    int8_kv.py): request b's lens[b] // bs full blocks as codes, then the rest of its keys
    from its staging block slots[b] of k_stage / v_stage [Hkv, S, bs, D]."""
    p = pools
    return torch.ops.alise_cpu.paged_decode_int8(
        q,
        p["kq"],
        p["ks"],
        p["ko"],
        p["vq"],
        p["vs"],
        p["vo"],
        k_stage,
        v_stage,
        tables,
        slots,
        lens,
        scale,
    )
