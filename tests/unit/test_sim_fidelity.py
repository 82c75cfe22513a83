"""The fidelity harness on a real (tiny, random-weight) engine: the live run serves every
request on the wall clock, and the simulator, given the engine's own measured profile,
produces numbers of the same order (a fixed profile here: the real check uses a measured one)."""

import pytest

from lab.sim.fidelity import check, live_run
from lab.workload.traces.trace import TraceItem


@pytest.fixture(scope="module")
def engine_and_profile(tmp_path_factory):
    import json

    from lab.scheduler.testing import cached_tiny_model
    from services.executor.engine import Engine

    engine = Engine(cached_tiny_model(), device="cpu", num_device_blocks=128, num_host_blocks=32)
    # a fixed profile (measuring one takes long on a shared machine; `alise sim fidelity`
    # uses a measured one)
    profile = {
        "coefficients": {"c0": 0.003, "c_prefill": 2e-5, "c_decode": 2e-5, "c_context": 1e-7},
        "block_size": 16,
    }
    path = tmp_path_factory.mktemp("fid") / "profile.json"
    path.write_text(json.dumps(profile))
    yield engine, path
    engine.close()


def _items():
    return [TraceItem(f"r{i}", 0.02 * i, 8 + 5 * i, 4 + (i % 5)) for i in range(12)]


def test_live_run_serves_every_request_on_the_wall_clock(engine_and_profile):
    import json

    engine, path = engine_and_profile
    records = live_run(engine, _items(), "sarathi", json.loads(path.read_text()))
    assert [r.output_len for r in records] == [i.output_len for i in _items()]
    for r in records:
        assert r.arrival_s <= r.first_scheduled_s <= r.token_times[0] <= r.finish_s


def test_check_reports_relative_errors(engine_and_profile):
    engine, path = engine_and_profile
    report = check(engine, _items(), "fcfs", str(path))
    assert set(report["relative_error"]) >= {"mean_e2e", "p99_tbt"}
    assert report["real"]["mean_e2e"] > 0 and report["sim"]["mean_e2e"] > 0
    assert abs(report["relative_error"]["mean_e2e"]) < 3.0  # same order of magnitude
