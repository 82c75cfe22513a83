"""The chaos benchmark's pure parts: the fault schedule, the per-request verdict, the added
latency per fault kind."""

from bench.bench_chaos import (
    KINDS,
    Fault,
    Outcome,
    added_latency_p99,
    check_tokens,
    compare,
    fault_schedule,
)


def test_schedule_is_seeded_inside_the_run_and_covers_every_kind():
    faults = fault_schedule(14, 100.0, seed=3)
    assert faults == fault_schedule(14, 100.0, seed=3)
    assert faults != fault_schedule(14, 100.0, seed=4)
    assert all(10.0 <= f.at_s <= 90.0 for f in faults)
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert sorted(f.kind for f in faults[: len(KINDS)]) == sorted(KINDS)  # a full cycle first
    assert {f.kind for f in fault_schedule(4, 10.0, 0, ("redis_kill",))} == {"redis_kill"}


def test_verdicts_tell_intact_clean_errors_and_corruption_apart():
    ref = [Outcome("hello world"), Outcome("abc"), Outcome("xyz"), Outcome("same")]
    got = [
        Outcome("hello world"),  # intact
        Outcome("ab", error="503"),  # cut cleanly: what came is a prefix
        Outcome("xyzz"),  # a repeated token, no error: corrupted
        Outcome("sXme", error="502"),  # an error after wrong text: corrupted too
    ]
    tally = compare(got, ref)
    assert (tally.intact, tally.clean_errors, tally.corrupted) == (1, 1, 2)
    assert tally.corrupted_ids == [2, 3]


def test_added_latency_counts_only_requests_in_flight_during_the_fault():
    ref = [Outcome("a", None, 0.0, 1.0), Outcome("b", None, 0.0, 1.0)]
    got = [Outcome("a", None, 0.0, 4.0), Outcome("b", None, 10.0, 11.5)]
    faults = [Fault(2.0, "scheduler_kill", start_s=2.0, end_s=3.0)]
    assert added_latency_p99(got, ref, faults) == {"scheduler_kill": 3.0}


def _got(rid: str, ids: list[int], error: str | None = None) -> Outcome:
    return Outcome(error=error, request_id=rid, token_ids=ids)


def test_token_invariant_finds_repeated_missing_and_trailing_tokens():
    committed = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9], "d": [1, 1, 2], "e": [3, 4, 5]}
    got = [
        _got("a", [1, 2, 3]),  # exact
        _got("b", [4, 5], error="502"),  # a clean error after a prefix
        _got("c", [7, 8, 8, 9]),  # a repeated token
        _got("d", [1, 2]),  # a missing token, no error
        _got("e", [3, 4, 5, 6]),  # a token after the end
        _got("", []),  # refused before admission: nothing to compare
        _got("zz", [1]),  # tokens nobody committed
        _got("a", [1, 3], error="503"),  # an error after a skipped token
    ]
    tally = check_tokens(got, committed, max_tokens=3)
    assert (tally.exact, tally.clean_errors, tally.unverifiable) == (1, 1, 1)
    assert tally.violation_ids == [2, 3, 4, 6, 7]
    # a complete answer shorter than max_tokens (ignore_eos) is a violation too
    assert check_tokens([_got("a", [1, 2, 3])], committed, max_tokens=4).violations == 1
