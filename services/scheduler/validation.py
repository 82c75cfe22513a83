"""GenerateRequest -> core Request, refusing malformed input with INVALID_ARGUMENT."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from services.common import sampling_pb
from services.common.censoring import expected_length
from services.common.grpc_server import invalid
from services.common.pb import scheduler_pb2
from services.common.sampling import SamplingParams
from services.scheduler.convert import slo_from_pb
from services.scheduler.core.request import Request

MAX_REQUEST_ID_LEN = 256


@dataclass
class ModelLimits:
    """What the executors told us about the model (None until one answered Describe)."""

    max_model_len: int | None = None
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_kv_tokens: int | None = None  # tokens the largest executor's KV pool can hold


def request_id_of(pb: scheduler_pb2.GenerateRequest) -> str:
    rid = pb.request_id or f"req-{uuid.uuid4().hex}"
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise invalid(f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
    return rid


def _check_prompt(prompt: list[int], limits: ModelLimits) -> None:
    if not prompt:
        raise invalid("prompt_token_ids is empty")
    if limits.max_model_len is not None and len(prompt) >= limits.max_model_len:
        raise invalid(
            f"prompt has {len(prompt)} tokens; the model's maximum length is "
            f"{limits.max_model_len} (prompt + at least one output token)"
        )
    if limits.max_kv_tokens is not None and len(prompt) >= limits.max_kv_tokens:
        raise invalid(
            f"prompt has {len(prompt)} tokens; the largest executor KV pool holds "
            f"{limits.max_kv_tokens} tokens (ALISE_KV_MEMORY_GB), prompt + output included"
        )
    bad = [t for t in prompt if t < 0 or (limits.vocab_size and t >= limits.vocab_size)]
    if bad:
        raise invalid(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})"
        )


def _sampling(pb: scheduler_pb2.GenerateRequest) -> SamplingParams:
    try:
        return sampling_pb.from_pb(pb.sampling)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def _check_limits(pb: scheduler_pb2.GenerateRequest, limits: ModelLimits) -> None:
    if pb.max_tokens <= 0:
        raise invalid(f"max_tokens must be > 0, got {pb.max_tokens}")
    total = len(pb.prompt_token_ids) + pb.max_tokens
    if limits.max_kv_tokens is not None and total > limits.max_kv_tokens:
        raise invalid(
            f"prompt + max_tokens = {total} tokens; the largest executor KV pool holds "
            f"{limits.max_kv_tokens} tokens (ALISE_KV_MEMORY_GB)"
        )
    if not 0 <= pb.min_tokens <= pb.max_tokens:
        raise invalid(f"min_tokens must be in [0, max_tokens], got {pb.min_tokens}")
    if any(t < 0 for t in pb.stop_token_ids):
        raise invalid("stop_token_ids must be >= 0")
    if pb.HasField("prediction") and pb.prediction.length < 0:
        raise invalid(f"prediction.length must be >= 0, got {pb.prediction.length}")
    for name in ("ttft_s", "tbt_s", "deadline_s"):
        if pb.slo.HasField(name) and not getattr(pb.slo, name) > 0:
            raise invalid(f"slo.{name} must be > 0 seconds, got {getattr(pb.slo, name)}")


def request_from_pb(
    pb: scheduler_pb2.GenerateRequest, rid: str, now: float, limits: ModelLimits
) -> Request:
    """A validated core Request. Without a prediction (or with length 0) `predicted_len` stays
    None and the policy applies its prior (`Policy.predicted_len`). A prediction becomes the
    expected length under max_tokens (`expected_length`): no answer is longer, whatever
    similar prompts got, and one predicted to run to the cap with probability `p_capped` is
    counted at max_tokens with that weight. (The core does not cap: the simulator ends
    requests by max_tokens = their true length, which would leak it.)"""
    prompt = list(pb.prompt_token_ids)
    _check_prompt(prompt, limits)
    _check_limits(pb, limits)
    sampling = _sampling(pb)
    predicted, source = None, "prior"
    if pb.HasField("prediction") and pb.prediction.length > 0:
        predicted, source = pb.prediction.length, pb.prediction.source or "client"
        predicted = expected_length(predicted, pb.prediction.p_capped, pb.max_tokens)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        max_tokens=pb.max_tokens,
        arrival_time=now,
        min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids),
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=pb.ignore_eos,
        priority=pb.priority if pb.HasField("priority") else 0,
        slo=slo_from_pb(pb.slo),
        sampling=sampling,
        predicted_len=predicted,
        prediction_source=source,
        max_model_len=limits.max_model_len,
    )
