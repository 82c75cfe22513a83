"""The chaos benchmark's pure parts: the fault schedule, the per-request verdict, the added
latency per fault kind."""

from bench.bench_chaos import KINDS, Fault, Outcome, added_latency_p99, compare, fault_schedule


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
