"""Core <-> proto: the one encode/decode path between the pure core and the wire.

`step_request` turns a core `SchedulerOutput` into the executor's `StepRequest` (1:1);
`step_outcome` turns a `StepResult` back into a core `StepOutcome`.
"""

from __future__ import annotations

from services.common import sampling_pb
from services.common.pb import common_pb2, executor_pb2, scheduler_pb2
from services.common.step import RemainingForecast, SchedulerOutput, StepOutcome
from services.scheduler.core.request import Slo


def slo_from_pb(pb: common_pb2.Slo) -> Slo:
    return Slo(
        ttft_s=pb.ttft_s if pb.HasField("ttft_s") else None,
        tbt_s=pb.tbt_s if pb.HasField("tbt_s") else None,
        deadline_s=pb.deadline_s if pb.HasField("deadline_s") else None,
    )


def step_request(out: SchedulerOutput) -> executor_pb2.StepRequest:
    """The executor's StepRequest for one core SchedulerOutput.
    Repeated fields are filled with `add(**fields)`: 3x faster than appending messages built
    one by one (23 vs 75 us for 64 decodes), and this runs between two Steps."""
    pb = executor_pb2.StepRequest(step_id=out.step_id)
    add_new = pb.new_requests.add
    for new in out.new_requests:
        add_new(
            request_id=new.request_id,
            token_ids=new.token_ids,
            sampling=sampling_pb.to_pb(new.sampling),
            num_output_tokens=new.num_output_tokens,
            num_cached_tokens=new.num_cached_tokens,
            max_tokens=new.max_tokens,
        )
    add_table = pb.block_tables.add
    for rid, (block_ids, replace) in out.block_tables.items():
        add_table(request_id=rid, block_ids=block_ids, replace=replace)
    add_scheduled = pb.scheduled.add
    for rid, n in out.num_scheduled_tokens.items():
        add_scheduled(request_id=rid, num_new_tokens=n)
    for s, d in out.swap_out:
        pb.swap_out.add(src=s, dst=d)
    for s, d in out.swap_in:
        pb.swap_in.add(src=s, dst=d)
    pb.free_request_ids.extend(out.free_request_ids)
    return pb


def step_outcome(result: executor_pb2.StepResult) -> StepOutcome:
    """The core's view of a StepResult: sampled (token, logprob) per request, step time, and
    the remaining-length forecasts made this step."""
    return StepOutcome(
        step_id=result.step_id,
        sampled={s.request_id: (s.token_id, s.logprob) for s in result.sampled},
        elapsed_s=result.timings.total_s,
        forecasts={
            f.request_id: RemainingForecast(f.generated, f.q10, f.q50, f.q90, f.p_cap)
            for f in result.forecasts
        },
    )


def prediction_pb(length: int | None, source: str) -> common_pb2.Prediction | None:
    if length is None:
        return None
    return common_pb2.Prediction(length=int(length), source=source)


def usage_pb(
    prompt_tokens: int,
    completion_tokens: int,
    arrival: float,
    first_scheduled: float | None,
    first_token: float | None,
    finished: float,
    num_preemptions: int,
    cached_tokens: int = 0,
) -> scheduler_pb2.Usage:
    return scheduler_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        queue_time_s=(first_scheduled - arrival) if first_scheduled else 0.0,
        ttft_s=(first_token - arrival) if first_token else 0.0,
        e2e_s=max(0.0, finished - arrival),
        num_preemptions=num_preemptions,
        cached_tokens=cached_tokens,
    )
