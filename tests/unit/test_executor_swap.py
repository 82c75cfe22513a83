"""Swapping KV to the host pool and back, and random step sequences that must never corrupt
another request's KV (hypothesis), on a tiny random-weight model."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.executor.tiny import make_tiny_model
from services.common.step import NewRequestData, SchedulerOutput
from services.executor.engine import Engine

PROMPT = list(range(400, 437))  # 37 tokens: 3 blocks of 16, the last one partly filled


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def _decode(engine, rid: str, n: int) -> list[int]:
    return [
        engine.step(SchedulerOutput(0, num_scheduled_tokens={rid: 1})).sampled[rid][0]
        for _ in range(n)
    ]


def _run(engine, swap: bool) -> list[int]:
    blocks = [0, 1, 2, 3, 4]
    tokens = [
        engine.step(
            SchedulerOutput(
                0, [NewRequestData("a", PROMPT)], {"a": (blocks, False)}, {"a": len(PROMPT)}
            )
        ).sampled["a"][0]
    ]
    tokens += _decode(engine, "a", 5)
    if swap:
        engine.step(SchedulerOutput(1, swap_out=[(b, 10 + b) for b in blocks]))
        # another request overwrites the freed device blocks meanwhile
        engine.step(
            SchedulerOutput(
                2, [NewRequestData("x", list(range(900, 970)))], {"x": (blocks, False)}, {"x": 70}
            )
        )
        engine.step(SchedulerOutput(3, free_request_ids=["x"]))
        new_blocks = [7, 9, 11, 13, 15]
        engine.step(
            SchedulerOutput(
                4,
                swap_in=[(10 + b, nb) for b, nb in zip(blocks, new_blocks)],
                block_tables={"a": (new_blocks, True)},
            )
        )
    return tokens + _decode(engine, "a", 10)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_swap_round_trip_mid_decode_continues_identically(tiny_dir, kv_dtype):
    kw = dict(num_device_blocks=16, num_host_blocks=16, kv_dtype=kv_dtype, dtype="fp32")
    plain = _run(Engine(tiny_dir, **kw), swap=False)
    swapped_engine = Engine(tiny_dir, **kw)
    swapped = _run(swapped_engine, swap=True)
    assert swapped == plain
    swapped_engine.close()


def test_compressed_swap_stores_int8_and_stays_close(tiny_dir):
    engine = Engine(
        tiny_dir, dtype="fp32", num_device_blocks=16, num_host_blocks=16, swap_compress=True
    )
    assert engine.swap.compress and engine.swap.host["kq"].dtype == torch.uint8
    assert engine.swap.host_bytes_per_block < 0.35 * engine.cache.bytes_per_block  # head_dim 16
    before = engine.cache.tensors["k"].clone()
    engine.step(
        SchedulerOutput(0, [NewRequestData("a", PROMPT)], {"a": ([0, 1, 2], False)}, {"a": 37})
    )
    written = engine.cache.tensors["k"][:, :, :2].clone()  # the two full blocks
    engine.step(SchedulerOutput(1, swap_out=[(0, 0), (1, 1)]))
    engine.step(SchedulerOutput(2, swap_in=[(0, 5), (1, 6)]))
    engine.swap.synchronize()
    restored = engine.cache.tensors["k"][:, :, 5:7]
    assert not torch.equal(written, before[:, :, :2])
    err = (restored - written).abs().max() / written.abs().max()
    assert 0 < err < 0.01  # lossy, but within INT8 rounding


# -- random step sequences ------------------------------------------------------------------
class MiniScheduler:
    """Random but valid steps: admits, chunked prefills, decodes, swaps, frees, block reuse."""

    def __init__(self, engine, rng: random.Random) -> None:
        self.engine, self.rng, self.bs = engine, rng, engine.block_size
        self.free_dev = list(range(engine.num_device_blocks))
        self.free_host = list(range(engine.num_host_blocks))
        self.reqs: dict[str, dict] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.n = 0

    def _take(self, pool: list[int], n: int) -> list[int] | None:
        if n > len(pool):
            return None
        self.rng.shuffle(pool)
        return [pool.pop() for _ in range(n)]

    def step(self) -> None:
        step = SchedulerOutput(self.n)
        self.n += 1
        self._maybe_admit(step)
        for rid, r in list(self.reqs.items()):
            action = self.rng.random()
            if rid in step.block_tables and r["done"] == 0:  # admitted in this step
                self._schedule(step, rid, r)
            elif r["host"] is not None:
                if action < 0.5:
                    self._swap_in(step, rid, r)
            elif action < 0.1:
                self._free(step, rid, r)
            elif action < 0.2 and rid not in step.block_tables:
                self._swap_out(step, rid, r)
            else:
                self._schedule(step, rid, r)
        out = self.engine.step(step, all_logits=True)
        for rid, logits in out.logits.items():
            self.logits[rid].append(logits)

    def _maybe_admit(self, step) -> None:
        if self.rng.random() < 0.5:
            length = self.rng.randint(1, 40)
            blocks = self._take(self.free_dev, -(-(length + 12) // self.bs))
            if blocks is not None:
                rid = f"q{self.n}"
                ids = self.rng.choices(range(50, 5000), k=length)
                step.new_requests.append(NewRequestData(rid, ids))
                step.block_tables[rid] = (blocks, False)
                self.reqs[rid] = {"len": length, "done": 0, "dev": blocks, "host": None}
                self.logits[rid] = []

    def _schedule(self, step, rid, r) -> None:
        room = min(r["len"] - r["done"], len(r["dev"]) * self.bs - r["done"])
        if room > 0:
            n = self.rng.randint(1, room)
            step.num_scheduled_tokens[rid] = n
            r["done"] += n
            r["len"] += 1 if r["done"] == r["len"] else 0  # a token gets sampled

    def _free(self, step, rid, r) -> None:
        step.free_request_ids.append(rid)
        self.free_dev.extend(r["dev"])
        del self.reqs[rid]

    def _swap_out(self, step, rid, r) -> None:
        host = self._take(self.free_host, len(r["dev"]))
        if host is not None:
            step.swap_out.extend(zip(r["dev"], host))
            self.free_dev.extend(r["dev"])
            r["dev"], r["host"] = [], host

    def _swap_in(self, step, rid, r) -> None:
        dev = self._take(self.free_dev, len(r["host"]))
        if dev is not None:
            step.swap_in.extend(zip(r["host"], dev))
            step.block_tables[rid] = (dev, True)
            self.free_host.extend(r["host"])
            r["dev"], r["host"] = dev, None


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(4, 14))
def test_random_steps_never_corrupt_other_requests(tiny_dir, hf_model, seed, steps):
    engine = Engine(tiny_dir, dtype="fp32", num_device_blocks=24, num_host_blocks=12)
    sched = MiniScheduler(engine, random.Random(seed))
    token_ids = {}
    for _ in range(steps):
        sched.step()
        token_ids.update({rid: list(s.token_ids) for rid, s in engine.requests.items()})
    for rid, parts in sched.logits.items():
        if not parts:
            continue
        ours = torch.cat(parts)
        with torch.no_grad():
            ref = hf_model(torch.tensor([token_ids[rid][: ours.shape[0]]])).logits[0]
        assert (ours - ref).abs().max() < 1e-4, f"request {rid} got wrong logits"
    engine.close()


def test_one_step_swaps_in_from_and_out_to_the_same_host_blocks(tiny_dir):
    """Copies are a parallel assignment: a host block read by a swap-in may be the target of
    a swap-out in the same step (and a device block swapped out may be a swap-in target)."""
    kw = dict(num_device_blocks=16, num_host_blocks=4, dtype="fp32")
    b_prompt = list(range(700, 728))  # 28 tokens + 3 decodes fit 2 blocks
    ref = Engine(tiny_dir, **kw)
    ref.step(
        SchedulerOutput(
            0,
            [NewRequestData("a", PROMPT), NewRequestData("b", b_prompt)],
            {"a": ([0, 1, 2], False), "b": ([3, 4], False)},
            {"a": 37, "b": 28},
        )
    )
    expected = [
        ref.step(SchedulerOutput(1, num_scheduled_tokens={"a": 1, "b": 1})).sampled
        for _ in range(3)
    ]
    engine = Engine(tiny_dir, **kw)
    engine.step(
        SchedulerOutput(
            0,
            [NewRequestData("a", PROMPT), NewRequestData("b", b_prompt)],
            {"a": ([0, 1, 2], False), "b": ([3, 4], False)},
            {"a": 37, "b": 28},
        )
    )
    engine.step(SchedulerOutput(1, swap_out=[(0, 0), (1, 1), (2, 2)]))  # a -> host 0..2
    engine.step(
        SchedulerOutput(
            2,
            swap_out=[(3, 0), (4, 1)],
            swap_in=[(0, 3), (1, 4), (2, 0)],
            block_tables={"a": ([3, 4, 0], True)},
        )
    )  # b -> host 0, 1
    engine.step(SchedulerOutput(3, swap_in=[(0, 5), (1, 6)], block_tables={"b": ([5, 6], True)}))
    got = [
        engine.step(SchedulerOutput(4, num_scheduled_tokens={"a": 1, "b": 1})).sampled
        for _ in range(3)
    ]
    assert got == expected


# -- overlap: a pending swap holds up only the steps that compute on its blocks ---------------
B_PROMPT = list(range(700, 728))  # 28 tokens: 2 blocks


def _hold_swap_worker(engine) -> threading.Event:
    """Occupy the SwapManager's single copy worker (its real thread pool) until the returned
    event is set: every swap queued meanwhile stays pending, as behind a long copy."""
    release = threading.Event()
    started = threading.Event()
    engine.swap.pool.submit(lambda: (started.set(), release.wait(60)))
    assert started.wait(10)
    return release


def _prefill_a_b(engine) -> None:
    engine.step(
        SchedulerOutput(
            0,
            [NewRequestData("a", PROMPT), NewRequestData("b", B_PROMPT)],
            {"a": ([0, 1, 2], False), "b": ([3, 4], False)},
            {"a": 37, "b": 28},
        )
    )


def test_pending_swap_does_not_block_other_requests_steps(tiny_dir):
    kw = {"num_device_blocks": 16, "num_host_blocks": 8, "dtype": "fp32"}
    b_alone = SchedulerOutput(0, num_scheduled_tokens={"b": 1})
    a_alone = SchedulerOutput(0, num_scheduled_tokens={"a": 1})
    both = SchedulerOutput(0, num_scheduled_tokens={"a": 1, "b": 1})
    ref = Engine(tiny_dir, **kw)  # the same batches, nothing swapped
    _prefill_a_b(ref)
    expected = [ref.step(s).sampled for s in (b_alone, b_alone, a_alone, both, both)]

    engine = Engine(tiny_dir, **kw)
    _prefill_a_b(engine)
    release = _hold_swap_worker(engine)
    got = []
    try:
        with ThreadPoolExecutor(1) as caller:

            def run(step):
                return caller.submit(engine.step, step)

            run(SchedulerOutput(1, swap_out=[(0, 0), (1, 1), (2, 2)])).result(timeout=30)
            swap_out_job = engine.swap.pending[0]
            out = run(b_alone).result(timeout=30)  # b's blocks are not being copied
            assert not swap_out_job.done() and out.timings.swap_wait_s < 0.05
            got.append(out.sampled)
            run(
                SchedulerOutput(
                    2, swap_in=[(0, 5), (1, 6), (2, 7)], block_tables={"a": ([5, 6, 7], True)}
                )
            ).result(timeout=30)
            out = run(b_alone).result(timeout=30)
            assert not swap_out_job.done() and out.timings.swap_wait_s < 0.05
            got.append(out.sampled)
            waiting = run(a_alone)  # a computes on blocks still arriving
            with pytest.raises(FutureTimeout):
                waiting.result(timeout=0.5)
            assert not swap_out_job.done()
            release.set()
            out = waiting.result(timeout=30)
            assert swap_out_job.done() and out.timings.swap_wait_s >= 0.4
            got.append(out.sampled)
            got += [run(both).result(timeout=30).sampled for _ in range(2)]
    finally:
        release.set()
        engine.close()
    assert got == expected


def test_step_reusing_swapped_out_blocks_waits_for_the_copy(tiny_dir):
    """The scheduler may hand a swapped-out request's device blocks to another request in
    the next step: that step must wait until the copy has read them, or it would overwrite
    the KV on its way to the host."""
    kw = {"num_device_blocks": 16, "num_host_blocks": 8, "dtype": "fp32"}
    x_prompt = list(range(900, 940))  # 40 tokens: fills blocks 0..2
    ref = Engine(tiny_dir, **kw)
    ref.step(
        SchedulerOutput(0, [NewRequestData("a", PROMPT)], {"a": ([0, 1, 2], False)}, {"a": 37})
    )
    expected = _decode(ref, "a", 6)
    x_ref = Engine(tiny_dir, **kw).step(
        SchedulerOutput(0, [NewRequestData("x", x_prompt)], {"x": ([0, 1, 2], False)}, {"x": 40})
    )

    engine = Engine(tiny_dir, **kw)
    engine.step(
        SchedulerOutput(0, [NewRequestData("a", PROMPT)], {"a": ([0, 1, 2], False)}, {"a": 37})
    )
    release = _hold_swap_worker(engine)
    try:
        engine.step(SchedulerOutput(1, swap_out=[(0, 0), (1, 1), (2, 2)]))
        with ThreadPoolExecutor(1) as caller:
            admit_x = caller.submit(
                engine.step,
                SchedulerOutput(
                    2, [NewRequestData("x", x_prompt)], {"x": ([0, 1, 2], False)}, {"x": 40}
                ),
            )
            with pytest.raises(FutureTimeout):
                admit_x.result(timeout=0.5)
            release.set()
            out = admit_x.result(timeout=30)
        assert out.timings.swap_wait_s >= 0.4 and out.sampled == x_ref.sampled
        engine.step(
            SchedulerOutput(
                3,
                free_request_ids=["x"],
                swap_in=[(0, 5), (1, 6), (2, 7)],
                block_tables={"a": ([5, 6, 7], True)},
            )
        )
        assert _decode(engine, "a", 6) == expected
    finally:
        release.set()
        engine.close()
