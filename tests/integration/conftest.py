"""Fixtures for integration tests that run the stack as separate processes."""

from __future__ import annotations

import pytest


@pytest.fixture
def stack_factory(tmp_path):
    """`make(**kw)` starts a `ProcessStack` with the tiny model (stopped after the test)."""
    from lab.gateway.testing import ProcessStack

    stacks = []

    def make(**kw):
        stack = ProcessStack(tmp_path / f"s{len(stacks)}", model="tiny", **kw)
        stacks.append(stack)
        return stack.__enter__()

    yield make
    for stack in stacks:
        stack.__exit__(None, None, None)
