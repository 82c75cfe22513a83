import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core.block_manager import BlockManager
from tests.unit.test_core_util import req


def test_allocate_hands_out_lowest_ids_and_grows_by_blocks():
    bm = BlockManager(8, 4, block_size=4)
    r = req("a", 6, 10)
    assert bm.allocate(r, 6) == [0, 1]
    r.num_computed_tokens = 6
    assert bm.allocate(r, 2) == []  # 8 tokens still fit 2 blocks
    assert bm.allocate(r, 3) == [2]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_device_blocks == 5
    assert bm.device_utilization == pytest.approx(3 / 8)


def test_failed_allocation_changes_nothing():
    bm = BlockManager(2, 0, block_size=4)
    r = req("a", 12, 1)
    assert not bm.can_allocate(r, 12)
    assert bm.allocate(r, 12) is None
    assert bm.num_free_device_blocks == 2 and bm.block_table("a") == []
    assert bm.allocate(req("b", 4, 1), 4, reserve_blocks=1) == [0]
    assert bm.allocate(req("c", 4, 1), 4, reserve_blocks=1) is None


def test_swap_roundtrip_and_quarantine():
    bm = BlockManager(4, 4, block_size=4)
    a = req("a", 8, 4)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    assert bm.swap_out("a", 8) == [(0, 0), (1, 1)]
    assert bm.is_swapped("a") and bm.num_free_device_blocks == 4
    assert bm.swap_in("a") == [(0, 0), (1, 1)]
    # host blocks read by the swap-in are not reusable until the next step
    assert bm.num_free_host_blocks == 2
    bm.check_invariants()
    bm.begin_step()
    assert bm.num_free_host_blocks == 4
    assert bm.free("a") == 2
    bm.check_invariants()


def test_swap_out_keeps_only_computed_blocks_and_fails_without_host_room():
    bm = BlockManager(8, 1, block_size=4)
    a = req("a", 8, 4)
    bm.allocate(a, 8)
    a.num_computed_tokens = 3
    assert bm.swap_out("a", 3) == [(0, 0)]
    assert bm.num_free_device_blocks == 8
    b = req("b", 8, 4)
    bm.allocate(b, 8)
    assert bm.swap_out("b", 8) is None and bm.is_on_device("b")
    with pytest.raises(ValueError):
        bm.allocate(a, 1)


@pytest.mark.parametrize("args", [(0, 1, 1), (1, -1, 1), (1, 1, 0)])
def test_bad_sizes_rejected(args):
    with pytest.raises(ValueError):
        BlockManager(*args)


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "free", "out", "in", "step"]),
        st.integers(0, 5),
        st.integers(1, 40),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(seq):
    """Random allocations, decode appends, frees, swaps and step boundaries: after every
    operation no block is lost or owned twice, a failed grow changes nothing, and an append
    leaves room for exactly one more token (at most one new block)."""
    bm = BlockManager(10, 6, block_size=4)
    reqs = {i: req(f"r{i}", 40, 40) for i in range(6)}
    for op, i, n in seq:
        r, rid = reqs[i], f"r{i}"
        before = bm.num_free_device_blocks + bm.num_free_host_blocks
        if op == "alloc" and not bm.is_swapped(rid):
            ok = bm.can_allocate(r, n)
            got = bm.allocate(r, n)
            assert (got is not None) == ok
            if got is None:
                assert bm.num_free_device_blocks + bm.num_free_host_blocks == before
            else:
                r.num_computed_tokens = min(r.num_computed_tokens + n, 80)
        elif op == "append" and bm.is_swapped(rid):
            with pytest.raises(ValueError):  # a decode needs its KV on the device
                bm.allocate(r, 1)
            assert bm.num_free_device_blocks + bm.num_free_host_blocks == before
        elif op == "append":
            ok, free = bm.can_allocate(r, 1), bm.num_free_device_blocks
            table = bm.block_table(rid)
            got = bm.allocate(r, 1)
            assert (got is not None) == ok
            if got is None:  # only when a new block was needed
                assert free == 0 and len(table) * 4 <= r.num_computed_tokens
                assert bm.block_table(rid) == table and bm.num_free_device_blocks == 0
            else:
                assert len(got) <= 1 and bm.block_table(rid) == table + got
                assert bm.num_free_device_blocks == free - len(got)
                assert bm.num_device_blocks_of(rid) * 4 >= r.num_computed_tokens + 1
                r.num_computed_tokens += 1
        elif op == "free":
            bm.free(rid)
            r.num_computed_tokens = 0
        elif op == "out" and bm.is_on_device(rid):
            bm.swap_out(rid, r.num_computed_tokens)
            if not bm.is_swapped(rid) and not bm.is_on_device(rid):
                r.num_computed_tokens = 0
        elif op == "in" and bm.is_swapped(rid):
            bm.swap_in(rid)
        elif op == "step":
            bm.begin_step()
        bm.check_invariants()
        assert bm.num_free_device_blocks >= 0 and bm.num_free_host_blocks >= 0
    for rid in [f"r{i}" for i in range(6)]:
        bm.free(rid)
    bm.begin_step()
    assert bm.num_free_device_blocks == 10 and bm.num_free_host_blocks == 6
