"""Simulation settings (picklable, so sweep workers can receive them) and policy-name parsing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

# KV bytes per token (K and V, fp16, all layers) for the models the roofline profiles name:
# 2 x layers x kv_heads x head_dim x 2 bytes.
KV_BYTES_PER_TOKEN = {
    "llama-2-7b": 2 * 32 * 4096 * 2,
    "opt-13b": 2 * 40 * 5120 * 2,
    "llama-3-8b": 2 * 32 * 1024 * 2,
    "smollm2-135m": 2 * 30 * 192 * 2,
}
DEFAULT_KV_BYTES_PER_TOKEN = KV_BYTES_PER_TOKEN["llama-2-7b"]
# (layers, hidden size) for the prefill-attention term: 4 * layers * hidden FLOPs per
# (query token, key token) pair (QK^T and PV), at the roofline's 60% of peak.
ATTENTION_SHAPES = {"llama-2-7b": (32, 4096), "llama-3-8b": (32, 4096), "opt-13b": (40, 5120)}
ATTENTION_MFU = 0.6


@dataclass(frozen=True)
class SimConfig:
    policy: str = "fcfs"  # a registered core policy name
    knobs: dict = field(default_factory=dict)  # passed to make_policy(policy, **knobs)
    profile: str = "a100-80g/llama-2-7b"  # roofline name or a profile JSON path
    num_executors: int = 1
    num_device_blocks: int | None = None  # default: the profile's
    num_host_blocks: int | None = None  # default: the profile's, else = device blocks
    block_size: int | None = None  # default: the profile's, else 16
    max_model_len: int = 4096
    prediction: str = "oracle"  # oracle | mean[:value=N] | noisy:sigma=S | file:PATH
    swap_bandwidth_gbs: float = 25.0  # host<->device copy bandwidth (PCIe 4 x16 ~ 25 GB/s)
    kv_bytes_per_token: int | None = None  # default: by model name (KV_BYTES_PER_TOKEN)
    overlap_swaps: bool = True  # swaps run beside compute (ALISE); else serialised
    prefix_caching: bool = False  # the core's prefix cache (needs traces with segments)
    cache_aware_placement: bool = True  # with several executors: cached prefix vs load only
    # seconds per (prefill token, context token) pair added to the clock for prefill chunks:
    # the O(n^2) attention FLOPs the linear cost model leaves out (None = off, -1 = from the
    # profile's GPU and model)
    prefill_attention_s: float | None = None
    # the clock: "measured" = the fitted cost model corrected by the profile's measured samples
    # nearest in shape (core/residual.py; the fit alone when the profile has no samples, as
    # roofline profiles), "fit" = the fitted linear model alone
    clock: str = "measured"
    seed: int = 0
    max_iterations: int = 5_000_000  # guard against a policy that never finishes

    def with_(self, **changes) -> SimConfig:
        return replace(self, **changes)

    @property
    def label(self) -> str:
        if not self.knobs:
            return self.policy
        return self.policy + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.knobs.items()))


def _value(text: str):
    """Knob values: JSON when it parses (numbers, true/false, lists), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_policy(spec: str) -> tuple[str, dict]:
    """`alise:memory=recompute,aging=0.5` -> ("alise", {"memory": "recompute", "aging": 0.5})."""
    name, _, rest = spec.strip().partition(":")
    if not name:
        raise ValueError(f"empty policy spec {spec!r}")
    knobs = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad knob {part!r} in {spec!r}: expected name=value")
        knobs[key.strip()] = _value(value.strip())
    return name, knobs


def load_profile(profile: str) -> dict:
    """A roofline name (`a100-80g/llama-2-7b`) or the path of a profile JSON file."""
    path = Path(profile)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"profile file not found: {path}")
        return json.loads(path.read_text())
    from services.scheduler.core.cost_model import roofline_profile

    return roofline_profile(profile)


def kv_bytes_per_token(config: SimConfig, profile: dict) -> int:
    if config.kv_bytes_per_token:
        return config.kv_bytes_per_token
    if profile.get("kv_bytes_per_token"):
        return int(profile["kv_bytes_per_token"])
    model = str(profile.get("model", "")).lower()
    for name, value in KV_BYTES_PER_TOKEN.items():
        if name in model:
            return value
    return DEFAULT_KV_BYTES_PER_TOKEN


def prefill_attention_coeff(config: SimConfig, profile: dict) -> float:
    """Seconds per (prefill token, attended token) pair, 0 when off."""
    value = config.prefill_attention_s
    if value is None or value == 0:
        return 0.0
    if value > 0:
        return value
    model = str(profile.get("model", "")).lower()
    shape = next((v for k, v in ATTENTION_SHAPES.items() if k in model), None)
    if shape is None or not profile.get("peak_flops"):
        raise ValueError(
            f"cannot derive the prefill attention term for model {model!r}: "
            "give seconds per token pair instead"
        )
    layers, hidden = shape
    return 4 * layers * hidden / (ATTENTION_MFU * float(profile["peak_flops"]))
