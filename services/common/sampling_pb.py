"""`SamplingParams` <-> proto `common.SamplingParams`: the one conversion each way."""

from __future__ import annotations

from services.common.pb import common_pb2
from services.common.sampling import SamplingParams


def to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k
    )
    if params.seed is not None:
        pb.seed = params.seed
    return pb


def from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError on an out-of-range field (see `SamplingParams`)."""
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p,
        top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None,
    )
