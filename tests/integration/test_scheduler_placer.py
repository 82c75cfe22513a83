"""Placement with cached outstanding work: same choices as the core's rule, O(1) per request."""

from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.placement import choose_executor
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.loop.placer import Placer


def sched(max_len: int = 512) -> Scheduler:
    cost = CostModel(c0=0.005, c_prefill=1e-4, c_decode=1e-4, c_context=1e-6)
    return Scheduler("fcfs", BlockManager(64, 0, 16), cost, max_len)


def req(rid: str, prompt: int, predicted: int) -> Request:
    return Request(rid, [5] * prompt, max_tokens=512, arrival_time=0.0, predicted_len=predicted)


def test_least_outstanding_work_and_capacity():
    schedulers = {"a": sched(), "b": sched(max_len=64)}
    schedulers["a"].admit(req("long", 100, 400))
    placer = Placer(refresh_s=1e9)  # never refresh: only the increments move the cache
    assert placer.choose(schedulers, req("x", 10, 10), 0.0) == "b"
    assert placer.choose(schedulers, req("big", 100, 10), 0.0) == "a"  # b cannot hold it
    assert placer.choose({"b": schedulers["b"]}, req("big", 100, 10), 0.0) is None
    # Placing short requests on b raises b's cached work until a is the lighter one again,
    # matching the core's rule evaluated on the real queues after each placement.
    for i in range(40):
        r = req(f"s{i}", 30, 100)
        chosen = placer.choose(schedulers, r, 0.0)
        assert chosen == choose_executor(schedulers, r, 0.0), i
        schedulers[chosen].admit(r)
        placer.placed(chosen, schedulers[chosen], r)
    assert schedulers["a"].num_waiting > 1 and schedulers["b"].num_waiting > 1
