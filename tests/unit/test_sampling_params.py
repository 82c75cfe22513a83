"""SamplingParams: one type from the gateway through the scheduler to the executor."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from services.common import sampling_pb
from services.common.grpc_server import ServiceError
from services.common.pb import common_pb2, scheduler_pb2
from services.common.sampling import SamplingParams
from services.common.step import NewRequestData, SchedulerOutput
from services.scheduler.convert import step_request
from services.scheduler.core.request import Request
from services.scheduler.store.records import new_record, request_from_record
from services.scheduler.validation import ModelLimits, request_from_pb


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": math.nan}, "temperature must be >= 0"),
        ({"top_p": 1.5}, "top_p must be in [0, 1], got 1.5"),
        ({"top_p": -0.1}, "top_p must be in [0, 1]"),
        ({"top_k": -2}, "top_k must be >= 0, got -2"),
    ],
)
def test_out_of_range_values_name_the_field(fields, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields)
    assert str(err.value).startswith(message)


def test_top_p_zero_means_disabled():
    assert SamplingParams(top_p=0).top_p == 1.0
    assert SamplingParams(temperature=0.5, top_p=0.0) == SamplingParams(temperature=0.5)
    assert SamplingParams(top_p=0.3).top_p == 0.3


def test_greedy():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8).greedy


def test_proto_round_trip_keeps_every_field():
    seeded = SamplingParams(temperature=0.5, top_p=0.25, top_k=40, seed=2**63 - 1)
    assert sampling_pb.from_pb(sampling_pb.to_pb(seeded)) == seeded
    unseeded = SamplingParams(temperature=1.5)
    pb = sampling_pb.to_pb(unseeded)
    assert not pb.HasField("seed")
    assert sampling_pb.from_pb(pb) == unseeded
    assert sampling_pb.from_pb(common_pb2.SamplingParams(seed=0)).seed == 0


def test_unset_proto_message_is_greedy_without_top_p():
    params = sampling_pb.from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams() and params.greedy and params.top_p == 1.0


def test_dict_round_trip_through_json():
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, seed=3)):
        assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_redis_record_round_trips_sampling():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=11)
    req = Request("r1", [1, 2, 3], 8, arrival_time=1.0, sampling=params)
    record = {k: str(v) for k, v in new_record(req, "m").items()}
    back = request_from_record("r1", record, [(9, -0.5, 2.0)])
    assert back.sampling == params and back.output_token_ids == [9]


def test_step_request_carries_sampling_to_the_executor():
    params = SamplingParams(temperature=0.5, top_k=3, seed=7)
    out = SchedulerOutput(step_id=4, new_requests=[NewRequestData("r", [1, 2], params, 0)])
    pb = step_request(out)
    assert sampling_pb.from_pb(pb.new_requests[0].sampling) == params


def test_gateway_request_with_bad_sampling_is_invalid_argument():
    pb = scheduler_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=4)
    pb.sampling.top_p = 1.5
    with pytest.raises(ServiceError) as err:
        request_from_pb(pb, "r", 0.0, ModelLimits())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p must be in [0, 1]" in err.value.message
    pb.sampling.top_p, pb.sampling.temperature = 0.0, 0.5
    assert request_from_pb(pb, "r", 0.0, ModelLimits()).sampling == SamplingParams(temperature=0.5)
