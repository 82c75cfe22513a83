"""Automatic prefix caching in the scheduling core: block sharing, reference counts, the LRU of
cached free blocks, swap and recompute with shared blocks, and policies that count only the
uncached tokens."""

import pytest

from services.common.step import StepOutcome
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.prefix_cache import chain_hashes
from services.scheduler.core.request import Request, RequestStatus
from tests.unit.test_core_util import SIMPLE, check_step, drive, make_sched, plan


def mk(rid, tokens, out_len=3, t=0.0, **kw):
    kw.setdefault("ignore_eos", True)
    return Request(rid, list(tokens), out_len, t, **kw)


def step(s, now=0.0, token=lambda r: 100 + r.num_output_tokens):
    """One schedule/update round; sampled tokens are a function of the request."""
    out = plan(s, now)
    check_step(s, out)
    reqs = s.requests
    sampled = {
        rid: (token(reqs[rid]), 0.0)
        for rid, n in out.num_scheduled_tokens.items()
        if reqs[rid].num_computed_tokens + n >= reqs[rid].num_tokens
    }
    s.update(StepOutcome(out.step_id, sampled, 0.01), now + 0.01)
    return out


def run_until_finished(s, req, limit=200):
    outs = []
    for i in range(limit):
        if req.is_finished:
            return outs
        outs.append(step(s, now=i * 0.01))
    raise AssertionError(f"{req.request_id} did not finish: {s.stats()}")


def cached_bm(device=16, host=8, bs=4, salt="m"):
    return BlockManager(device, host, bs, enable_prefix_caching=True, cache_salt=salt)


# -- hashes -----------------------------------------------------------------------------------
def test_chain_hash_depends_on_parent_tokens_and_salt():
    a = chain_hashes(list(range(12)), 4, "llama/fp16")
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_hashes(list(range(12)), 4, "llama/fp16") == a  # deterministic
    assert chain_hashes(list(range(12)), 4, "llama/int8") != a  # the KV dtype changes the KV
    # same second block after a different first block: a different hash (chained)
    b = chain_hashes([9, 9, 9, 9] + list(range(4, 8)), 4, "llama/fp16")
    assert b[1] != a[1]
    assert chain_hashes(list(range(10)), 4, "llama/fp16") == a[:2]  # partial block: no hash


# -- reuse ------------------------------------------------------------------------------------
def test_request_extending_a_finished_one_reuses_exactly_its_full_blocks():
    s = make_sched("fcfs", device_blocks=32, host_blocks=0, block_size=4, prefix_caching=True)
    a = mk("a", range(1, 11), out_len=3)  # 10 prompt tokens
    s.admit(a)
    assert a.num_computed_tokens == 0
    run_until_finished(s, a)
    # a computed 10 prompt + 2 output tokens (its last token's KV is never computed):
    # 3 full blocks, all registered
    a_blocks = [s.block_manager.cache.by_hash[h] for h in chain_hashes(a.all_token_ids[:12], 4)]
    assert len(a_blocks) == 3
    b = mk("b", a.all_token_ids + [50, 51, 52, 53, 54])  # a's history + a new message
    s.admit(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 12
    out = step(s, now=1.0)
    assert out.num_scheduled_tokens == {"b": b.num_prompt_tokens - 12}
    (new,) = out.new_requests
    assert new.num_cached_tokens == 12 and new.token_ids == b.prompt_token_ids
    table = s.block_manager.block_table("b")
    assert table[:3] == a_blocks and not set(table[3:]) & set(a_blocks)
    assert out.block_tables["b"] == (table, False)
    assert s.stats()["prefix_cache_hits"] == 12


def test_whole_prompt_cached_still_computes_a_token():
    bm = cached_bm(bs=4)
    first = mk("x", range(8))
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.commit(first)
    bm.free("x")
    assert bm.cached_prefix_len(mk("y", range(8))) == 4  # block-aligned: the last block again
    assert bm.cached_prefix_len(mk("z", list(range(8)) + [1, 2])) == 8
    assert bm.cached_prefix_len(mk("w", [0, 1, 2, 9] + list(range(4, 8)))) == 0


def test_a_request_reading_prompt_logits_takes_nothing_from_the_cache():
    """prompt_logprobs needs the logits of every prompt position: no cached prefix until the
    request has output (a recompute after its first token may use the cache again)."""
    from dataclasses import replace

    bm = cached_bm(bs=4)
    first = mk("x", range(12))
    bm.allocate(first, 12)
    first.num_computed_tokens = 12
    bm.commit(first)
    bm.free("x")
    reader = mk("y", range(12))
    reader.sampling = replace(reader.sampling, prompt_logprobs=0)
    assert bm.cached_prefix_len(mk("z", range(12))) == 8
    assert bm.cached_prefix_len(reader) == 0 and bm.cache.peek(reader) == 0
    reader.output_token_ids.append(5)
    assert bm.cached_prefix_len(reader) == 12


def test_concurrent_requests_share_a_system_prompt():
    s = make_sched("sarathi", device_blocks=32, block_size=4, prefix_caching=True, token_budget=64)
    system = list(range(200, 216))  # 4 full blocks
    a = mk("a", system + [1, 2, 3], out_len=20)
    s.admit(a)
    step(s)  # a's prefill: its 4 system blocks become cacheable
    b = mk("b", system + [7, 8], out_len=20)
    s.admit(b)
    assert b.num_computed_tokens == 16
    out = step(s, now=0.02)
    assert out.num_scheduled_tokens["b"] == 2
    bm = s.block_manager
    shared = bm.block_table("a")[:4]
    assert bm.block_table("b")[:4] == shared
    assert [bm.cache.ref[x] for x in shared] == [2, 2, 2, 2]
    assert bm.block_table("a")[4] != bm.block_table("b")[4]  # the partial blocks stay private
    bm.check_invariants()
    s.abort("a", 0.05)
    assert [bm.cache.ref[x] for x in shared] == [1, 1, 1, 1]
    s.abort("b", 0.05)
    assert bm.num_free_device_blocks == 32 and bm.num_cached_free_blocks >= 4
    bm.check_invariants()


# -- eviction ---------------------------------------------------------------------------------
def _cache_request(bm, rid, tokens):
    r = mk(rid, tokens)
    bm.allocate(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    bm.commit(r)
    return r, bm.block_table(rid)


def test_eviction_is_lru_among_unreferenced_blocks_only():
    bm = cached_bm(device=8, host=0, bs=4)
    _, a = _cache_request(bm, "a", range(0, 8))
    _, b = _cache_request(bm, "b", range(100, 108))
    held, h = _cache_request(bm, "h", range(300, 308))  # stays referenced
    bm.free("a")  # freed first: least recently used
    bm.free("b")
    assert bm.num_free_device_blocks == 6 and bm.num_cached_free_blocks == 4
    # a new request needs 3 blocks: 2 plain free ones, then the oldest cached: a's last block
    new = mk("n", range(500, 512))
    assert bm.allocate(new, 12) is not None
    assert bm.cached_prefix_len(mk("a2", list(range(0, 8)) + [1])) == 4  # a's head survives
    assert bm.cached_prefix_len(mk("b2", list(range(100, 108)) + [1])) == 8
    assert bm.cache.evictions == 1
    # more: a's head, then b's blocks (tail first); the held blocks are never touched
    assert bm.allocate(mk("m", range(600, 612)), 12) is not None
    assert bm.cache.evictions == 4 and bm.num_free_device_blocks == 0
    assert bm.cached_prefix_len(mk("h2", list(range(300, 308)) + [1])) == 8
    assert bm.block_table("h") == h
    assert bm.allocate(mk("o", range(700, 704)), 4) is None  # nothing evictable left
    bm.check_invariants()
    del held, a, b


def test_attaching_a_cached_block_takes_it_out_of_the_lru():
    bm = cached_bm(device=4, host=0, bs=4)
    _cache_request(bm, "a", range(8))
    bm.free("a")
    r = mk("r", list(range(8)) + [9])
    r.num_computed_tokens = bm.cached_prefix_len(r)
    assert r.num_computed_tokens == 8
    assert bm.num_new_blocks(r, 1) == 3  # 1 fresh + 2 cached blocks taken out of the LRU
    assert bm.allocate(r, 1, reserve_blocks=2) is None  # check then act: nothing changed
    assert bm.num_cached_free_blocks == 2
    table = bm.allocate(r, 1)
    assert len(table) == 3 and bm.num_cached_free_blocks == 0
    assert bm.num_free_device_blocks == 1
    bm.check_invariants()


def test_stale_cached_prefix_is_refused_by_allocate():
    bm = cached_bm(bs=4)
    r = mk("r", range(9))
    r.num_computed_tokens = 8  # nothing is cached
    with pytest.raises(ValueError, match="counted as cached"):
        bm.allocate(r, 1)


# -- swap and recompute -----------------------------------------------------------------------
def test_swap_out_moves_only_blocks_held_alone_and_swap_in_restores_positions():
    bm = cached_bm(device=16, host=8, bs=4)
    a, a_table = _cache_request(bm, "a", range(16))
    b = mk("b", list(range(8)) + [40, 41, 42, 43, 44, 45])
    b.num_computed_tokens = bm.cached_prefix_len(b)
    assert b.num_computed_tokens == 8
    bm.allocate(b, 6)
    b.num_computed_tokens = 14
    bm.commit(b)
    b_table = bm.block_table("b")
    assert b_table[:2] == a_table[:2]
    pairs = bm.swap_out("b", 14)
    assert [d for d, _ in pairs] == b_table[2:]  # only its own blocks are copied
    assert bm.is_swapped("b") and bm.num_kept_blocks_of("b") == 2
    assert [bm.cache.ref[x] for x in a_table[:2]] == [1, 1]  # they stay, held by a
    assert bm.num_swap_in_blocks(b, 1) == 2  # its 2 host blocks; the shared ones are free
    bm.check_invariants()
    bm.free("a")  # now only cached: swapping b in re-attaches them from the LRU
    assert not bm.swap_in_lost("b") and bm.num_swap_in_blocks(b, 1) == 4
    back = bm.swap_in("b")
    table = bm.block_table("b")
    assert table[:2] == a_table[:2] and [d for _, d in back] == table[2:]
    bm.check_invariants()
    bm.free("b")
    bm.begin_step()
    assert bm.num_free_device_blocks == 16 and bm.num_free_host_blocks == 8
    bm.check_invariants()
    del a


def test_swap_out_of_a_request_whose_blocks_are_all_shared_copies_nothing():
    bm = cached_bm(device=8, host=2, bs=4)
    _cache_request(bm, "a", range(12))
    b = mk("b", list(range(8)) + [1])
    b.num_computed_tokens = bm.cached_prefix_len(b)
    bm.allocate(b, 1)
    assert bm.swap_out("b", 8) == []
    assert bm.is_swapped("b") and bm.num_host_blocks_of("b") == 0
    bm.check_invariants()
    assert bm.swap_in("b") == [] and len(bm.block_table("b")) == 2
    bm.check_invariants()


def test_swapped_request_whose_shared_block_was_evicted_is_recomputed():
    s = make_sched("fcfs", device_blocks=12, host_blocks=8, block_size=4, prefix_caching=True)
    system = list(range(100, 116))
    a = mk("a", system + [1], out_len=50)
    s.admit(a)
    step(s)
    b = mk("b", system + [2, 3], out_len=50)
    s.admit(b)
    step(s, now=0.01)
    assert s.block_manager.block_table("b")[:4] == s.block_manager.block_table("a")[:4]
    batch = s.new_batch(0.02)
    assert batch.preempt(b, "swap") and b.status is RequestStatus.SWAPPED
    assert batch.finish().swap_out  # b's own block (its partial one) is copied
    s.abort("a", 0.03)  # the shared blocks are now only cached...
    filler = mk("f", range(500, 540), out_len=1)  # ...and a long prompt evicts them
    s.block_manager.allocate(filler, 40)
    assert s.block_manager.swap_in_lost("b")
    s.block_manager.free("f")
    batch = s.new_batch(0.04)
    assert not batch.swap_in(b)
    out = batch.finish()
    assert b.status is RequestStatus.WAITING and "b" in out.free_request_ids
    bm = s.block_manager
    assert not bm.is_swapped("b") and not bm.is_on_device("b")
    # what is left of the shared prefix is still re-attached
    assert b.num_computed_tokens == b.num_cached_tokens == bm.cached_prefix_len(b) < 16
    s.block_manager.check_invariants()
    drive(s, [])
    assert b.finish_reason == "length" and b.num_tokens == s.max_model_len == 48


def test_recompute_keeps_the_cached_prefix():
    s = make_sched("fcfs", device_blocks=64, block_size=4, prefix_caching=True)
    r = mk("r", range(1, 23), out_len=10)  # 22 prompt tokens
    s.admit(r)
    for i in range(4):
        step(s, now=i * 0.01)
    computed = r.num_computed_tokens
    table = s.block_manager.block_table("r")
    b = s.new_batch(1.0)
    assert b.preempt(r, "recompute")
    out = b.finish()
    assert "r" in out.free_request_ids and r.status is RequestStatus.WAITING
    assert r.num_computed_tokens == r.num_cached_tokens == computed // 4 * 4
    cached, known = computed // 4 * 4, r.num_tokens
    out = step(s, now=1.1)  # re-admitted: only the tokens past the cached blocks are computed
    assert out.num_scheduled_tokens == {"r": known - cached}
    assert out.new_requests[0].num_cached_tokens == cached
    assert s.block_manager.block_table("r")[: cached // 4] == table[: cached // 4]


# -- policies see only uncached tokens ---------------------------------------------------------
def _warm(policy, prompt, **knobs):
    s = make_sched(policy, device_blocks=256, block_size=16, prefix_caching=True, **knobs)
    first = mk("first", prompt, out_len=2)
    s.admit(first)
    run_until_finished(s, first)
    return s


def test_sarathi_schedules_only_the_uncached_rest_within_its_budget():
    prompt = list(range(1000, 1300))  # 300 tokens; 18 full blocks of 16 cached
    s = _warm("sarathi", prompt, token_budget=64)
    r = mk("r", prompt + [1, 2], out_len=4)
    s.admit(r)
    assert r.num_computed_tokens == 288 and r.num_uncomputed_tokens == 14
    out = step(s, now=1.0)
    assert out.num_scheduled_tokens == {"r": 14}  # uncached rest; without caching 64 (a chunk)
    assert r.num_output_tokens == 1  # first token after one step instead of five
    assert out.num_prefill_tokens == 14 and out.num_context_tokens == 302


def test_hybrid_and_alise_estimate_remaining_time_from_uncached_tokens():
    prompt = list(range(2000, 2600))  # 600 tokens
    for policy in ("hybrid", "alise"):
        s = _warm(policy, prompt)
        r = mk("r", prompt + [5], out_len=8, predicted_len=8)
        s.admit(r)
        uncached = r.num_uncomputed_tokens
        assert uncached == 601 - 592
        assert s.policy.levels.rem["r"] == pytest.approx(SIMPLE.remaining_time(r, 8))
        cold = mk("cold", list(range(5000, 5601)), out_len=8, predicted_len=8)
        assert s.policy.levels.rem["r"] < SIMPLE.remaining_time(cold, 8) - 500 * SIMPLE.t0


def test_accelgen_and_hybrid_do_not_treat_a_mostly_cached_prompt_as_long():
    prompt = list(range(3000, 3700))
    for policy in ("accelgen", "hybrid"):
        s = _warm(policy, prompt)
        r = mk("r", prompt + [1, 2, 3], out_len=4)
        s.admit(r)
        assert r.num_uncached_prompt_tokens == 703 - 688
        out = step(s, now=1.0)
        assert out.num_scheduled_tokens == {"r": 15}


def test_cache_off_by_default_changes_nothing():
    s = make_sched("fcfs", device_blocks=64, block_size=4)
    a = mk("a", range(12))
    s.admit(a)
    run_until_finished(s, a)
    b = mk("b", a.all_token_ids + [1])
    s.admit(b)
    assert b.num_computed_tokens == 0 and s.block_manager.cache is None
    assert "prefix_cache_hits" not in s.stats()
    out = step(s, now=1.0)
    assert out.num_scheduled_tokens == {"b": 16} and out.new_requests[0].num_cached_tokens == 0


def test_multi_turn_conversation_prefill_work_shrinks_with_the_cache():
    def total_prefill(caching):
        s = make_sched("hybrid", device_blocks=128, block_size=16, prefix_caching=caching)
        history, work = list(range(64)), 0
        for turn in range(4):
            r = mk(f"t{turn}", history + [900 + turn] * 20, out_len=10)
            trace = drive(s, [r], token=lambda q, i, base=700 + 10 * turn: base + i)
            work += sum(o.num_prefill_tokens for _, _, o in trace)
            history = r.all_token_ids
        return work

    cold, warm = total_prefill(False), total_prefill(True)
    assert warm < cold / 2


# -- placement --------------------------------------------------------------------------------
def test_cache_aware_placement_prefers_the_cached_prefix_within_one_prefill_of_load():
    from services.scheduler.core.placement import choose_executor

    def fresh():
        return make_sched(
            "fcfs", device_blocks=64, host_blocks=0, block_size=4, prefix_caching=True
        )

    a, b = fresh(), fresh()
    first = mk("t1", range(1, 41), out_len=3)
    a.admit(first)
    run_until_finished(a, first)
    follow = mk("t2", first.all_token_ids + [60, 61, 62])
    saved = a.prefix_saving(follow)
    assert saved == 40 * a.cost_model.t0 and b.prefix_saving(follow) == 0.0
    assert "t2" not in a.block_manager.cache._hashes  # looking did not remember the request
    # equal load: the executor holding the prefix; load only: the first name either way
    assert choose_executor({"x": b, "y": a}, follow, 1.0) == "y"  # though "x" sorts first
    assert choose_executor({"x": b, "y": a}, follow, 1.0, cache_aware=False) == "x"
    # "a" busier by less than the saving: still "a"; by more: "b"
    filler = mk("f", range(200, 204), out_len=2)
    a.admit(filler)
    busy = a.outstanding_work(1.0)
    assert 0 < busy < saved
    assert choose_executor({"a": a, "b": b}, follow, 1.0) == "a"
    for i in range(30):
        a.admit(mk(f"g{i}", range(300 + i, 340 + i), out_len=20))
    assert a.outstanding_work(1.0) > saved
    assert choose_executor({"a": a, "b": b}, follow, 1.0) == "b"
    assert choose_executor({"a": fresh(), "b": a}, follow, 1.0, cache_aware=False) == "a"
