"""Core `Request` <-> Redis record (a flat hash of strings) and re-admission copies."""

from __future__ import annotations

import dataclasses
import json

from services.common.sampling import SamplingParams
from services.scheduler.core.request import Request, RequestStatus, Slo


def new_record(req: Request, model: str) -> dict[str, str | int | float]:
    """The hash written when a request is admitted."""
    params = {
        "prompt": req.prompt_token_ids,
        "max_tokens": req.max_tokens,
        "min_tokens": req.min_tokens,
        "stop": list(req.stop_token_ids),
        "eos": list(req.eos_token_ids),
        "ignore_eos": req.ignore_eos,
        "priority": req.priority,
        "slo": dataclasses.asdict(req.slo),
        "sampling": req.sampling.to_dict(),
        "max_model_len": req.max_model_len,
        "model": model,
    }
    return {
        "params": json.dumps(params, separators=(",", ":")),
        "status": req.status.value,
        "executor": "",
        "arrival": req.arrival_time,
        "predicted_len": req.predicted_len or 0,
        "prediction_source": req.prediction_source,
        "n_out": 0,
        "num_preemptions": 0,
    }


def request_from_record(
    rid: str, record: dict[str, str], tokens: list[tuple[int, float, float]]
) -> Request:
    """Rebuild a request from Redis: known output kept, nothing computed (it is recomputed)."""
    p = json.loads(record["params"])
    predicted = int(record.get("predicted_len") or 0) or None
    first_sched = float(record["first_scheduled"]) if record.get("first_scheduled") else None
    return Request(
        request_id=rid,
        prompt_token_ids=list(p["prompt"]),
        max_tokens=p["max_tokens"],
        arrival_time=float(record["arrival"]),
        min_tokens=p["min_tokens"],
        stop_token_ids=tuple(p["stop"]),
        eos_token_ids=tuple(p["eos"]),
        ignore_eos=p["ignore_eos"],
        priority=p["priority"],
        slo=Slo(**p["slo"]),
        sampling=SamplingParams.from_dict(p["sampling"]),
        predicted_len=predicted,
        prediction_source=record.get("prediction_source", "prior"),
        output_token_ids=[t[0] for t in tokens],
        output_logprobs=[t[1] for t in tokens],
        token_times=[t[2] for t in tokens],
        first_scheduled_time=first_sched,
        num_preemptions=int(record.get("num_preemptions", 0)),
        max_model_len=p.get("max_model_len"),
    )


def recompute_copy(req: Request, preempted: bool = True) -> Request:
    """A fresh copy of `req` to admit again elsewhere: output kept, nothing computed, no policy
    state carried over; counts as one preemption when it lost KV (`preempted`)."""
    return dataclasses.replace(
        req,
        output_token_ids=list(req.output_token_ids),
        output_logprobs=list(req.output_logprobs),
        token_times=list(req.token_times),
        num_computed_tokens=0,
        num_pending_tokens=0,
        status=RequestStatus.WAITING,
        finish_reason=None,
        finished_time=None,
        num_preemptions=req.num_preemptions + int(preempted),
    )


def queue_of(status: RequestStatus) -> str | None:
    """The Redis queue (sorted set) a request in `status` belongs to; None once finished."""
    if status.is_finished:
        return None
    return status.value
