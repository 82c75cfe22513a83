"""Load a Hugging Face safetensors checkpoint into a flat {name: tensor} dict."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)
Rename = Callable[[str], str | None]


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (random weights for its config.json: "
            "load_format=dummy)"
        )
    return files


def our_name(name: str, rename: Rename | None) -> str | None:
    """A checkpoint tensor's key: any leading `model.` stripped, then the family's rename
    (None: a tensor the executor does not use, e.g. a vision tower)."""
    key = name[len("model.") :] if name.startswith("model.") else name
    return rename(key) if rename else key


def load_state(
    model_dir: Path, dtype: torch.dtype, device: torch.device, rename: Rename | None = None
) -> dict[str, torch.Tensor]:
    """All tensors the family uses (our_name), converted to `dtype` on `device`."""
    from safetensors import safe_open

    from services.executor import fp8

    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}  # FP8 weights and their scales (fp8.py)
    skipped = 0
    for path in _files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                key = our_name(name, rename)
                if key is None:
                    skipped += 1
                    continue
                t = f.get_tensor(name)
                if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or fp8.is_scale(key):
                    quantized[key] = t
                else:
                    state[key] = t.to(device=device, dtype=dtype)
    if quantized:
        state.update(fp8.dequantize_state(quantized, dtype, device))
    if skipped:
        log.info(
            "%s: %d tensors not used by the language model skipped (vision tower)",
            model_dir,
            skipped,
        )
    return state


LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02  # transformers' initializer_range default
DUMMY_PERIOD = 1_048_583  # a prime: values drawn per tensor, repeated after (cheap on CPU)


def _fill_random(x: torch.Tensor, gen: torch.Generator) -> None:
    """N(0, DUMMY_STD^2) values, the first DUMMY_PERIOD drawn and then repeated by doubling
    copies (a prime period: no two rows of a matrix share their values' alignment), so an
    8B-shaped layer fills at memory speed on a CPU."""
    flat = x.view(-1)
    n = flat.numel()
    flat[: min(n, DUMMY_PERIOD)].normal_(0.0, DUMMY_STD, generator=gen)
    done = min(n, DUMMY_PERIOD)
    while done < n:
        k = min(done, n - done)
        flat[done : done + k].copy_(flat[:k])
        done += k


def dummy_state(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    rename: Rename | None = None,
    norm_fill: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Random weights with the names and shapes of the checkpoint `model_dir/config.json`
    describes (vLLM's --load-format dummy): matrices ~ N(0, DUMMY_STD^2) (_fill_random), norm
    weights `norm_fill` (1; 0 for (1 + w) norms), biases 0, drawn on `device` from `seed`. The names come from transformers' model built on
    the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "quantization_config", None):  # an FP8 shape: its full-precision names
        del config.quantization_config
    with torch.device("meta"):
        shapes = {
            k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # the embedding serves as the LM head
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        key = our_name(name, rename)
        if key is None:
            continue
        x = torch.empty(shape, dtype=dtype, device=device)
        if len(shape) == 1:
            x.fill_(norm_fill if "norm" in name else 0.0)
        else:
            _fill_random(x, gen)
        state[key] = x
    return state


def take(state: dict[str, torch.Tensor], name: str, required: bool = True) -> torch.Tensor | None:
    if name not in state:
        if required:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return None
    return state[name]


def cat_rows(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    """Fuse projections that read the same input into one matrix (or bias)."""
    if any(t is None for t in tensors):
        return None
    return torch.cat(tensors, dim=0).contiguous()
