import pytest

from services.common.step import StepOutcome
from services.scheduler.core.placement import choose_executor
from services.scheduler.core.policies import available_policies, make_policy, policy_knobs
from services.scheduler.core.request import Request, RequestStatus, Slo
from tests.unit.test_core_util import EOS, drive, make_sched, plan, req


def _step(s, now, tokens=None):
    out = plan(s, now)
    sampled = {
        rid: ((tokens or {}).get(rid, 7), -0.1)
        for rid in out.num_scheduled_tokens
        if s.requests[rid].num_computed_tokens + out.num_scheduled_tokens[rid]
        >= s.requests[rid].num_tokens
    }
    return out, s.update(StepOutcome(out.step_id, sampled), now + 0.01)


def test_first_step_sends_new_request_and_blocks():
    s = make_sched("fcfs", block_size=4)
    s.admit(req("a", 10, 3))
    out = plan(s, 0.0)
    assert out.step_id == 1
    assert [n.request_id for n in out.new_requests] == ["a"]
    assert out.new_requests[0].token_ids == [5] * 10
    assert out.block_tables == {"a": ([0, 1, 2], False)}
    assert out.num_scheduled_tokens == {"a": 10}
    assert out.num_prefill_tokens == 10 and out.num_decode_tokens == 0
    ups = s.update(StepOutcome(1, {"a": (9, -0.2)}), 0.5)
    assert ups[0].token == (9, -0.2, 0) and not ups[0].finished
    r = s.requests["a"]
    assert r.num_computed_tokens == 10 and r.output_token_ids == [9] and r.token_times == [0.5]
    out2 = plan(s, 0.5)
    assert out2.new_requests == [] and out2.num_decode_tokens == 1
    assert out2.block_tables == {}  # 11 tokens still fit 3 blocks of 4


def test_stop_conditions_and_frees_in_next_output():
    s = make_sched("fcfs")
    s.admit(Request("eos", [1] * 4, 10, 0.0, eos_token_ids=(EOS,), min_tokens=2))
    s.admit(Request("stop", [1] * 4, 10, 0.0, stop_token_ids=(42,)))
    s.admit(Request("len", [1] * 4, 2, 0.0, eos_token_ids=(EOS,)))
    _, ups = _step(s, 0.0, {"eos": EOS, "stop": 42, "len": 3})
    done = {u.request_id: u.finish_reason for u in ups if u.finished}
    assert done == {"stop": "stop"}  # EOS ignored before min_tokens
    out, ups = _step(s, 1.0, {"eos": EOS, "len": 3})
    assert out.free_request_ids == ["stop"]
    done = {u.request_id: u.finish_reason for u in ups if u.finished}
    assert done == {"eos": "stop", "len": "length"}
    assert s.requests["eos"].status is RequestStatus.FINISHED_STOPPED
    out = plan(s, 2.0)
    assert sorted(out.free_request_ids) == ["eos", "len"]
    assert not s.has_unfinished and s.block_manager.num_free_device_blocks == 256


def test_max_model_len_and_validation():
    s = make_sched("fcfs", max_model_len=12)
    with pytest.raises(ValueError, match="no room"):
        s.admit(req("big", 12, 5))
    s.admit(Request("a", [1] * 10, 100, 0.0))
    drive(s, [])
    assert s.requests["a"].num_tokens == 12 and s.requests["a"].finish_reason == "length"
    with pytest.raises(ValueError, match="already exists"):
        s.admit(req("x", 3, 1)) or s.admit(req("x", 3, 1))
    with pytest.raises(ValueError):
        Request("r", [], 5, 0.0)
    with pytest.raises(ValueError):
        Slo(ttft_s=-1)


def test_abort_while_in_flight_and_wrong_step():
    s = make_sched("fcfs")
    s.admit(req("a", 8, 5))
    out = plan(s, 0.0)
    with pytest.raises(RuntimeError):
        plan(s, 0.0)
    assert s.abort("a", 0.001) and not s.abort("a", 0.002)
    with pytest.raises(ValueError):
        s.update(StepOutcome(out.step_id + 1, {}), 0.01)
    assert s.update(StepOutcome(out.step_id, {"a": (7, 0.0)}), 0.01) == []
    assert s.requests["a"].finish_reason == "abort"
    assert plan(s, 0.02).free_request_ids == ["a"]


def test_missing_sample_is_an_error():
    s = make_sched("fcfs")
    s.admit(req("a", 8, 5))
    out = plan(s, 0.0)
    with pytest.raises(ValueError, match="no token"):
        s.update(StepOutcome(out.step_id, {}), 0.01)


def test_registry_and_knob_errors():
    names = available_policies()
    for name in ["fcfs"]:
        assert name in names
    with pytest.raises(ValueError, match="valid knobs"):
        make_policy("fcfs", no_such_knob=1)
    with pytest.raises(ValueError, match="available"):
        make_policy("nope")
    with pytest.raises(ValueError, match="preemption_mode"):
        make_policy("fcfs", preemption_mode="drop")
    assert "watermark" in policy_knobs("fcfs")


def test_fcfs_prefill_first_and_recompute_preemption():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks; decoding grows them
    s = make_sched("fcfs", device_blocks=6, block_size=4, watermark=0.0)
    a, b = req("a", 8, 12, 0.0), req("b", 8, 12, 0.0)
    trace = drive(s, [a, b])
    first = trace[0][2]
    assert first.num_scheduled_tokens == {"a": 8, "b": 8} and first.num_decode_tokens == 0
    preempted = [rid for _, _, o in trace for rid in o.preempted_request_ids]
    assert preempted and preempted[0] == "b"  # the newest yields
    resent = [o for _, _, o in trace if any(n.request_id == "b" for n in o.new_requests)]
    assert len(resent) == 2  # re-sent after recompute with its output
    assert resent[1].new_requests[0].num_output_tokens > 0
    assert a.num_output_tokens == b.num_output_tokens == 12


def test_fcfs_swap_mode_swaps_out_and_back():
    s = make_sched(
        "fcfs", device_blocks=6, host_blocks=8, block_size=4, watermark=0.0, preemption_mode="swap"
    )
    a, b = req("a", 8, 12, 0.0), req("b", 8, 12, 0.0)
    trace = drive(s, [a, b])
    assert any(o.swap_out for _, _, o in trace) and any(o.swap_in for _, _, o in trace)
    swapped_in = [o for _, _, o in trace if o.swap_in]
    assert all(o.block_tables["b"][1] is True for o in swapped_in)
    assert b.num_preemptions >= 1 and b.num_output_tokens == 12


def test_placement_prefers_least_outstanding_work():
    s1, s2 = make_sched("fcfs"), make_sched("fcfs", max_model_len=64)
    s1.admit(req("x", 100, 200))
    assert choose_executor({"a": s1, "b": s2}, req("y", 10, 10), 0.0) == "b"
    assert choose_executor({"a": s1, "b": s2}, req("z", 100, 10), 0.0) == "a"
    assert choose_executor({"b": s2}, req("w", 100, 10), 0.0) is None
    # a re-admitted request needs room for its output too
    assert choose_executor({"b": s2}, _readmitted("v", 61, [7] * 3, 10), 0.0) is None
    assert choose_executor({"b": s2}, _readmitted("u", 60, [7] * 3, 3), 0.0) is None
    assert choose_executor({"b": s2}, _readmitted("t", 60, [7] * 3, 10), 0.0) == "b"


def test_free_only_output_is_not_in_flight():
    s = make_sched("fcfs")
    s.admit(req("a", 4, 1))
    out = plan(s, 0.0)
    s.update(StepOutcome(out.step_id, {"a": (7, 0.0)}), 0.01)
    frees = plan(s, 0.02)
    assert frees.free_request_ids == ["a"] and not frees.num_scheduled_tokens
    assert s.update(StepOutcome(frees.step_id, {}), 0.03) == []  # sent: accepted as no-op
    s.admit(req("b", 4, 1, t=0.03))
    assert plan(s, 0.04).num_scheduled_tokens == {"b": 4}  # dropped: still fine


def _readmitted(rid="a", prompt=6, output=(9, 8), max_tokens=5, **kw) -> Request:
    """A request rebuilt after a restart: known output, nothing computed, WAITING."""
    return Request(
        rid,
        [5] * prompt,
        max_tokens,
        0.0,
        ignore_eos=True,
        output_token_ids=list(output),
        output_logprobs=[-0.1] * len(output),
        token_times=[0.1 * (i + 1) for i in range(len(output))],
        **kw,
    )


def test_readmitted_request_is_recomputed_from_prompt_and_output():
    s = make_sched("fcfs", block_size=4)
    s.admit(_readmitted())
    out = plan(s, 1.0)
    (new,) = out.new_requests
    assert new.token_ids == [5] * 6 + [9, 8] and new.num_output_tokens == 2
    assert out.num_scheduled_tokens == {"a": 8} and out.num_decode_tokens == 0
    ups = s.update(StepOutcome(out.step_id, {"a": (3, -0.5)}), 1.5)
    assert ups[0].token == (3, -0.5, 2)  # index continues after the kept output
    r = s.requests["a"]
    assert r.output_token_ids == [9, 8, 3] and r.token_times == [0.1, 0.2, 1.5]
    drive(s, [])
    assert r.num_output_tokens == 5 and r.finish_reason == "length"


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_finishes_readmitted_requests(policy):
    s = make_sched(policy, block_size=4)
    reqs = [
        _readmitted(
            f"r{i}",
            prompt=5 + i,
            output=[7] * i,
            max_tokens=6,
            predicted_len=2,
            slo=Slo(ttft_s=0.5, tbt_s=0.2),
        )
        for i in range(1, 5)
    ]
    drive(s, reqs)
    assert all(r.num_output_tokens == 6 and r.finish_reason == "length" for r in reqs)
    assert s.block_manager.num_free_device_blocks == 256


def test_readmitted_prediction_is_doubled_past_its_output():
    s = make_sched("alise")
    r = _readmitted(output=[7] * 10, max_tokens=100, predicted_len=4)
    s.admit(r)
    assert s.predicted_len(r) == 16 and s.policy.rank.demotions["a"] == 1


def test_readmission_validation():
    s = make_sched("fcfs", max_model_len=12)
    running = _readmitted("run")
    running.status = RequestStatus.RUNNING
    computed = _readmitted("comp")
    computed.num_computed_tokens = 3
    for bad, match in [
        (running, "must be waiting"),
        (computed, "nothing computed"),
        (_readmitted("done", output=[7] * 5), "nothing left to generate"),
        (
            _readmitted("full", prompt=8, output=[7] * 4, max_tokens=9),
            r"prompt of 8 tokens \+ 4 output tokens leaves no room",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            s.admit(bad)
    assert not s.requests and not s.has_unfinished
    ok = _readmitted("ok", prompt=8, output=[7] * 3, max_tokens=9)  # 11 + 1 fits
    s.admit(ok)
    drive(s, [])
    assert ok.num_tokens == 12 and ok.finish_reason == "length"


def test_finished_request_is_dropped_once_its_free_is_acknowledged():
    s = make_sched("fcfs")
    a = req("a", 4, 1)
    s.admit(a)
    out = plan(s, 0.0)
    s.update(StepOutcome(out.step_id, {"a": (7, 0.0)}), 0.01)
    assert a.is_finished and s.requests["a"] is a  # its free is not out yet
    s.admit(req("b", 4, 2, t=0.01))
    out = plan(s, 0.02)
    assert out.free_request_ids == ["a"] and "a" in s.requests  # that step may still fail
    s.update(StepOutcome(out.step_id, {"b": (7, 0.0)}), 0.03)
    assert "a" not in s.requests and not s.abort("a", 0.03)
    c = req("c", 4, 2, t=0.03)  # never sent: dropped when aborted
    s.admit(c)
    assert s.abort("c", 0.03) and "c" not in s.requests
    out = plan(s, 0.04)
    assert "c" not in out.free_request_ids and list(s.requests) == ["b"]
    s.update(StepOutcome(out.step_id, {"b": (7, 0.0)}), 0.05)
    frees = plan(s, 0.06)  # free-only output, never acknowledged
    assert frees.free_request_ids == ["b"] and "b" in s.requests
    assert plan(s, 0.07).is_empty and s.requests == {}  # the next schedule drops it
    s.admit(req("a", 4, 1, t=0.07))  # the id may be used again
    assert plan(s, 0.08).num_scheduled_tokens == {"a": 4}


@pytest.mark.parametrize("policy", available_policies())
def test_core_keeps_no_finished_requests_in_a_long_run(policy):
    s = make_sched(policy, device_blocks=64, block_size=4)
    peak = []

    def only_just_finished(s, out):
        done = {rid for rid, r in s.requests.items() if r.is_finished}
        assert done <= set(out.num_scheduled_tokens)  # finished by this very step
        peak.append(len(s.requests))

    arrivals = [req(f"r{i}", 3 + i % 7, 1 + i % 5, t=0.002 * i) for i in range(120)]
    drive(s, arrivals, on_step=only_just_finished)
    assert max(peak) < 120 and s.num_finished == 120
    plan(s, 1e3)  # sends the last frees
    plan(s, 1e3)
    assert s.requests == {}
