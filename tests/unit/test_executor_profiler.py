"""The self-profiler on a tiny engine: its grid, its samples and the tokens it times."""

from __future__ import annotations

import pytest

from lab.executor.tiny import make_tiny_model
from services.common.step import SchedulerOutput
from services.executor.engine import Engine
from services.executor.profiler import StepTimer, grid_points, profile_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=3)
    eng = Engine(model, device="cpu", dtype="fp32", num_device_blocks=256)
    yield eng
    eng.close()


def test_each_timed_request_has_its_own_seeded_tokens(engine):
    """Rows of one batch differ (a mixture of experts routes them apart, as live rows), and
    a timer of the same seed draws the same tokens again; another seed draws others."""
    prompts = []
    for seed in (0, 0, 1):
        step, timer = SchedulerOutput(0), StepTimer(engine, seed)
        timer._new(step, 32, 31)
        timer._new(step, 32, 31)
        prompts.append([r.token_ids for r in step.new_requests])
    (a, b), again, other = prompts
    assert a != b and len(set(a)) > 8
    assert again == [a, b] and other[0] != a
    assert all(0 < t < engine.spec.vocab_size for t in a + b)


def test_quick_profile_times_every_grid_point_it_fits(engine):
    profile = profile_engine(engine, quick=True)
    points = grid_points(StepTimer(engine), quick=True)
    assert len(profile["samples"]) == len(points) >= 4
    timed = {(s["prefill_tokens"], s["decode_tokens"]) for s in profile["samples"]}
    assert timed == {(p, d) for p, d, _ in points}
    assert all(s["time_s"] > 0 for s in profile["samples"])
    assert profile["coefficients"]["c0"] >= 0 and profile["quick"] is True
    assert not engine.requests  # the timer gives back every request it made
