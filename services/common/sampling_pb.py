"""`SamplingParams` <-> proto `common.SamplingParams`: the one conversion each way."""

from __future__ import annotations

from services.common.pb import common_pb2
from services.common.sampling import SamplingParams


def to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
        top_logprobs=params.top_logprobs,
        guide_kind=params.guide_kind,
        guide_spec=params.guide_spec,
        bad_words=[common_pb2.TokenSequence(token_ids=list(w)) for w in params.bad_words],
    )
    if params.seed is not None:
        pb.seed = params.seed
    if params.prompt_logprobs is not None:
        pb.prompt_logprobs = params.prompt_logprobs
    return pb


def from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError on an out-of-range field (see `SamplingParams`)."""
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p,
        top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty,
        min_p=pb.min_p,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        top_logprobs=pb.top_logprobs,
        guide_kind=pb.guide_kind,
        guide_spec=pb.guide_spec,
        bad_words=tuple(tuple(w.token_ids) for w in pb.bad_words),
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
    )
