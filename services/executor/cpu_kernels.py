"""Compiled CPU kernels (csrc/): paged decode attention read straight from the KV pool, full
precision and INT8 (paged_decode.cpp), the MLP's SiLU-and-multiply and RMSNorm (activation.cpp).

Built at run time with torch's extension builder (a C++ compiler and ninja, both in the
executor image and `make setup`), once per machine and ISA level: the build is cached under
`TORCH_EXTENSIONS_DIR` (default ~/.cache/torch_extensions) in a directory named after the
level and a digest of the sources, flags and torch version. The first build takes ~25 s on a
2-core machine; later loads take well under a second. Where the build fails (no compiler),
`load()` logs why once and returns False: the executor then uses the torch attention
(attention.py), which computes the same thing.

ISA levels (`ALISE_CPU_ISA`): `auto` builds for the highest x86-64 level the CPU runs,
`x86-64-v4` (AVX-512) or `x86-64-v3` (AVX2, FMA, F16C), never for the CPU model itself, so an
AMX or AVX512-FP16 machine runs the same machine code as any other AVX-512 one. The kernels
take no -ffast-math and fix every reduction's order (csrc/vec.h): a v3 build and a v4 build
return the same numbers. `native` (-march=native) can still be asked for. Each build registers
its ops under a namespace of its own, so one process can load several (the tests compare
them).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.executor.config import cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_decode.cpp", "activation.cpp")]
HEADERS = [CSRC / "vec.h"]
# No -ffast-math: it lets the compiler reorder sums by vector width and call libm's vector
# exp, whose AVX2 and AVX-512 versions differ; its parts that reorder nothing are kept (the
# kernels never meet an infinity or a NaN: softmax starts from a real score). -fopenmp: torch's parallel_for runs on torch's
# own OpenMP threads (the same libgomp).
CFLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-ffp-contract=fast",
    "-fopenmp",
]
# /proc/cpuinfo flags each x86-64 level needs (the psABI's levels; lzcnt shows as abm).
V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
V4_FLAGS = V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVEL_FLAGS = {"x86-64-v3": V3_FLAGS, "x86-64-v4": V4_FLAGS}
LEVELS = (*LEVEL_FLAGS, "native")


@dataclass(frozen=True)
class Build:
    """One loaded build: its ISA level and its ops (torch.ops.<namespace>)."""

    level: str
    namespace: str

    @property
    def ops(self) -> Any:
        return getattr(torch.ops, self.namespace)


_lock = threading.Lock()
_builds: dict[str, Build | None] = {}  # level -> build (None: it failed)
_active: Build | None = None
_tried = False


def runnable_levels(flags: set[str] | None = None) -> list[str]:
    """The levels this CPU runs, lowest first (`native` always, last)."""
    have = cpu_flags() if flags is None else flags
    return [lvl for lvl, need in LEVEL_FLAGS.items() if need <= have] + ["native"]


def requested_level(flags: set[str] | None = None) -> str | None:
    """ALISE_CPU_ISA resolved: `auto` (default) is the highest of v4 and v3 this CPU runs
    (None: neither, so no kernels); a named level is taken as it is."""
    want = os.environ.get("ALISE_CPU_ISA", "auto").strip().lower() or "auto"
    if want == "auto":
        fixed = [lvl for lvl in runnable_levels(flags) if lvl != "native"]
        return fixed[-1] if fixed else None
    if want not in LEVELS:
        raise ValueError(f"ALISE_CPU_ISA={want!r}: auto or one of {', '.join(LEVELS)}")
    return want


def build_name(level: str) -> str:
    """The extension's (and its op namespace's) name: the level and a digest of the sources,
    flags and torch version (and, for `native`, the CPU's flags)."""
    h = hashlib.sha1(" ".join([level, torch.__version__, *CFLAGS]).encode())
    for path in SOURCES + HEADERS:
        h.update(path.read_bytes())
    if level == "native":
        h.update(" ".join(sorted(cpu_flags())).encode())
    tag = level.replace("x86-64-", "")
    return f"alise_cpu_{tag}_{h.hexdigest()[:12]}"


def _ensure_ninja_on_path() -> None:
    """torch's builder runs `ninja`; the pip package installs it next to this interpreter,
    which is not on PATH when the executor is started by absolute path."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def load() -> bool:
    """Build (first time on this machine) and load the kernels of the requested level, and
    use them; False, logged once, where they cannot be built. Thread-safe; later calls
    return the first answer."""
    global _active, _tried
    with _lock:
        if not _tried:
            _tried = True
            _active = _first_build()
        return _active is not None


def _first_build() -> Build | None:
    if disabled():
        log.info("compiled CPU kernels off (ALISE_CPU_KERNELS): torch attention")
        return None
    level = requested_level()
    if level is None:
        log.info("compiled CPU kernels need x86-64-v3 (AVX2, FMA, F16C): torch attention")
        return None
    return _load_level(level)


def load_level(level: str) -> Build | None:
    """Build and load `level` beside whatever else is loaded (None where it fails)."""
    with _lock:
        return _load_level(level)


def use(level: str) -> bool:
    """Make `level`'s build the one the executor calls (loading it first); False where it
    cannot be built."""
    global _active, _tried
    with _lock:
        build = _load_level(level)
        if build is not None:
            _active, _tried = build, True
        return build is not None


def active_level() -> str | None:
    return _active.level if _active else None


def disabled() -> bool:
    """ALISE_CPU_KERNELS=off (or 0, false): never build them, use the torch attention."""
    return os.environ.get("ALISE_CPU_KERNELS", "").lower() in ("0", "false", "off")


STALE_BATON_S = 60.0  # a torch build lock file this old, found under our flock, is dead


@contextlib.contextmanager
def _no_stale_baton(name: str) -> Iterator[None]:
    """torch's builder guards a build directory with a lock *file* (`lock`, its FileBaton),
    taken on every load: a process killed while holding it (an executor SIGKILLed while it
    starts) leaves it behind, and every later load on the machine waits for it forever
    (measured: both executors of `alise serve` stuck "loading" after a chaos kill). Loaders
    here first take an flock on a file beside it, which the kernel drops when its holder dies;
    holding that, a lock file is a dead process's, or one of a loader without this flock (an
    older version on the same machine): it is waited for while younger than STALE_BATON_S,
    then removed."""
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with open(build_dir / "alise-load.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        baton = build_dir / "lock"
        while baton.exists():
            try:
                age = time.time() - baton.stat().st_mtime
            except FileNotFoundError:
                break
            if age >= STALE_BATON_S:
                log.warning("removing a build lock left by a killed process: %s", baton)
                baton.unlink(missing_ok=True)
                break
            time.sleep(0.5)
        yield


def _load_level(level: str) -> Build | None:
    if level in _builds:
        return _builds[level]
    name = build_name(level)
    march = "native" if level == "native" else level
    try:
        from torch.utils.cpp_extension import load as load_extension

        _ensure_ninja_on_path()
        with _no_stale_baton(name):
            load_extension(
                name,
                sources=[str(p) for p in SOURCES],
                extra_cflags=[*CFLAGS, f"-march={march}", f"-DALISE_NS={name}"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        build: Build | None = Build(level, name)
    except Exception as exc:  # no compiler, no headers, a failed build: all mean "use torch"
        reason = " ".join(str(exc).split())[:300]
        log.warning("compiled CPU kernels (%s) unavailable, using torch: %s", level, reason)
        build = None
    _builds[level] = build
    return build


def loaded() -> bool:
    """Whether the kernels are loaded in this process (never builds them)."""
    return _active is not None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for the fused gate/up output [T, 2I]: one op on CPU once the
    kernels are loaded, torch's two elsewhere."""
    if _active and x.device.type == "cpu" and x.is_contiguous():
        return _active.ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' LlamaRMSNorm in one op once the kernels are loaded (x [..., H] and the
    weight of one dtype, contiguous, on CPU); None where the caller's torch path must run."""
    if (
        _active
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
    ):
        return _active.ops.rms_norm(x, weight, eps)
    return None


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [B, H, D] (one query per request) against the paged pools [Hkv, NB, bs, D] of one
    layer, request b reading its first lens[b] keys through tables[b] -> [B, H, D]; a
    sliding-window layer (`window` > 0) sees only the last `window` of them, and `softcap` > 0
    bends scores to softcap * tanh(score / softcap) before the softmax."""
    return _ops().paged_decode(q, k_pool, v_pool, tables, lens, scale, window, softcap)


def paged_decode_int8(
    q: torch.Tensor,
    pools: dict[str, torch.Tensor],
    k_stage: torch.Tensor,
    v_stage: torch.Tensor,
    tables: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """As paged_decode over one layer of an INT8 pool (`pools`: kq ks ko vq vs vo, see
    int8_kv.py): request b's lens[b] // bs full blocks as codes, then the rest of its keys
    from its staging block slots[b] of k_stage / v_stage [Hkv, S, bs, D]."""
    p = pools
    return _ops().paged_decode_int8(
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
        window,
        softcap,
    )


def _ops() -> Any:
    if _active is None:
        raise RuntimeError("compiled CPU kernels are not loaded (cpu_kernels.load())")
    return _active.ops
