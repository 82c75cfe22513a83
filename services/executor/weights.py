"""Load a Hugging Face safetensors checkpoint into a flat {name: tensor} dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_state(
    model_dir: Path, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """All tensors, converted to `dtype` on `device`, with any leading `model.` stripped."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in _files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                key = name[len("model.") :] if name.startswith("model.") else name
                state[key] = f.get_tensor(name).to(device=device, dtype=dtype)
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
