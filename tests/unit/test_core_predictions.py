"""The live service caps a request's prediction at its max_tokens (no answer is longer); the
core itself keeps predictions as given (the simulator's max_tokens is the true length)."""

from lab.scheduler.testing import core_request, gen_request
from services.common.pb import common_pb2
from tests.unit.test_core_util import make_sched, req


def _with_prediction(length: int, max_tokens: int):
    pb = gen_request("r", [5, 6, 7], max_tokens)
    pb.prediction.CopyFrom(common_pb2.Prediction(length=length, source="retrieval"))
    return core_request(pb, eos_token_ids=(2,), max_model_len=4096)


def test_service_caps_predictions_at_max_tokens():
    assert _with_prediction(900, 12).predicted_len == 12
    assert _with_prediction(7, 12).predicted_len == 7
    assert _with_prediction(7, 12).prediction_source == "retrieval"


def test_capped_short_job_overtakes_a_long_one():
    # "capped" came with a huge prediction but max_tokens 10: the service capped it
    s = make_sched("alise", max_num_seqs=1)
    long = req("long", 50, 300, t=0.0, predicted_len=300)
    capped = req("capped", 50, 10, t=0.001, predicted_len=_with_prediction(5000, 10).predicted_len)
    uncapped = make_sched("alise", max_num_seqs=1)
    long2 = req("long", 50, 300, t=0.0, predicted_len=300)
    big = req("big", 50, 10, t=0.001, predicted_len=5000)
    from tests.unit.test_core_util import drive

    drive(s, [long, capped])
    drive(uncapped, [long2, big])
    assert capped.finished_time < long.finished_time
    assert big.finished_time > long2.finished_time  # the core trusts what it is given
