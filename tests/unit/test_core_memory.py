"""A long-running scheduler keeps no state of a request once it has finished: after many
requests (demoted, SLO-bound, preempted, with and without prefix caching) under every policy,
nothing per request is left in the core (soak: the scheduler's memory stays flat)."""

from __future__ import annotations

import random

import pytest

from lab.scheduler.testing import BOUNDED, retained
from services.scheduler.core.policies.base import _REGISTRY
from services.scheduler.core.request import Slo
from tests.unit.test_core_util import drive, make_sched, req


def workload(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        kw: dict = {}
        if i % 3 == 0:
            kw["predicted_len"] = rng.randint(1, 6)  # outgrown: demoted (doubled)
        if i % 4 == 0:
            kw["slo"] = Slo(ttft_s=0.05, tbt_s=0.02)
        r = req(f"r{i}", rng.randint(4, 80), rng.randint(1, 40), t=0.003 * i, **kw)
        r.true_len = r.max_tokens  # the oracle's
        reqs.append(r)
    return reqs


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("policy", sorted(_REGISTRY))
def test_nothing_is_kept_of_finished_requests(policy, caching):
    s = make_sched(policy, device_blocks=64, host_blocks=256, prefix_caching=caching)
    reqs = workload(120)
    drive(s, reqs, check=False)
    assert s.num_finished == len(reqs)
    # the last output's frees are acknowledged by the next schedule with nothing in flight;
    # by then every aging or TTFT deadline is long past
    s.schedule(1e9)
    s.schedule(1e9 + 1)
    left = retained(s, "sched") | retained(s.policy, "policy")
    assert left == {}, left


def test_prefix_cache_keeps_at_most_the_pool_of_distinct_prompts():
    """The one thing that grows with requests served: the prefix cache's registry of ended
    requests' blocks, until every device block is registered; then it evicts (a soak sees the
    scheduler's memory rise while it fills, then flatten)."""
    blocks = 48
    s = make_sched("hybrid", device_blocks=blocks, host_blocks=64, prefix_caching=True)
    reqs = [req(f"u{i}", 40, 8, t=0.001 * i) for i in range(60)]
    for i, r in enumerate(reqs):  # a shared first block, then a prompt of its own
        r.prompt_token_ids[16:] = [1000 + i] * 24
    drive(s, reqs, check=False)
    s.schedule(1e9)
    cache = s.block_manager.cache
    assert cache.evictions > 0  # 60 requests, each with a block of its own, > 48 blocks
    assert len(cache.by_hash) == len(cache.hash_of) == len(cache.lru) <= blocks
    assert s.block_manager.num_cached_free_blocks == len(cache.lru)
    assert retained(cache, "cache", BOUNDED) == {}
