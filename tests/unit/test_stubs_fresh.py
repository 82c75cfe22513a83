"""The committed stubs must equal what the committed .proto files generate."""

from services.common import protogen


def test_stubs_match_protos(tmp_path):
    written = protogen.generate(tmp_path)
    assert {p.name for p in written} >= {
        "executor_pb2.py",
        "scheduler_pb2_grpc.py",
        "predictor_pb2.py",
        "common_pb2.py",
    }
    committed = {p.name: p.read_text() for p in protogen.PB_DIR.iterdir() if p.is_file()}
    fresh = {p.name: p.read_text() for p in written}
    assert set(fresh) == set(committed), "stub files differ: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs (run `make proto`): {stale}"


def test_stubs_import_from_the_package():
    from services.common.pb import (
        executor_pb2,
        executor_pb2_grpc,
        predictor_pb2_grpc,
        scheduler_pb2,
        scheduler_pb2_grpc,
    )

    req = executor_pb2.StepRequest(step_id=7)
    req.scheduled.add(request_id="r", num_new_tokens=3)
    assert (
        executor_pb2.StepRequest.FromString(req.SerializeToString()).scheduled[0].num_new_tokens
        == 3
    )
    assert scheduler_pb2.GenerateRequest(prompt_token_ids=[1, 2]).HasField("prediction") is False
    assert hasattr(executor_pb2_grpc, "ExecutorStub")
    assert hasattr(scheduler_pb2_grpc, "SchedulerServicer")
    assert hasattr(predictor_pb2_grpc, "add_PredictorServicer_to_server")
