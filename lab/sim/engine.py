"""The event loop: one heap, deterministic tie-breaks, the cost model as the clock.

Events are (time, kind, sequence number): at equal times a step end comes before a swap
completion, which comes before an arrival, and equal kinds keep their push order. After all
events of one instant are applied, every idle executor with work builds its next batch, so a
batch sees every request that arrived by then. Nothing reads the wall clock.

Each executor is one core `Scheduler` (its own policy instance and block manager); arrivals
are placed with the core's `choose_executor`. A step lasts the cost model's iteration time of
its batch; swaps move `blocks x block_size x kv_bytes_per_token` bytes at the configured
bandwidth, overlapped with the forward pass (ALISE) or added to it. Sampled tokens are
dummies; a request ends at max_tokens = its true output length (ignore_eos), or, when the
prediction spec carries forecasts (`ARRIVAL+FORECAST`, sim/forecasts.py), on an EOS at its
true length with max_tokens the deployment's cap, and its forecasts arrive in the step
outcomes at the executor's checkpoints. Prompts are
dummies too, except for trace items with `segments` (multi-turn chats, shared system prompts):
their ids are built per segment, so with `prefix_caching` the core's prefix cache finds what
repeats, and placement is cache-aware unless `cache_aware_placement` is off.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from dataclasses import dataclass
from functools import lru_cache

from lab.sim.config import SimConfig, kv_bytes_per_token, load_profile, prefill_attention_coeff
from lab.sim.forecasts import ForecastSource, make_forecasts, split_spec
from lab.sim.predictions import predict_lengths
from lab.workload.metrics import IterationRecord
from lab.workload.traces.trace import TraceItem
from services.common.step import SchedulerOutput, StepOutcome
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.policies import make_policy
from services.scheduler.core.request import Request, Slo
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.shape import StepShape

STEP_END, SWAP_DONE, ARRIVAL = 0, 1, 2
DUMMY_TOKEN = 0
EOS_TOKEN = 2  # sampled at a request's true length when max_tokens does not end it


def prompt_tokens(item: TraceItem) -> list[int]:
    """Token ids for a trace item's prompt: its segments' (equal ids give equal runs, so the
    prefix cache sees what repeats), else dummies (a prompt of its own)."""
    if not item.segments:
        return [DUMMY_TOKEN] * item.prompt_len
    ids: list[int] = []
    for segment, n in item.segments:
        ids += _segment_tokens(segment, n)
    return ids


@lru_cache(maxsize=4096)
def _segment_tokens(segment: str, n: int) -> tuple[int, ...]:
    seed = int.from_bytes(hashlib.blake2b(segment.encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 32000) for _ in range(n))


class SimulationError(RuntimeError):
    """The run cannot make progress (a policy stalls with work left) or exceeded its guard."""


@dataclass
class Executor:
    name: str
    scheduler: Scheduler
    busy: bool = False
    step: tuple | None = None  # (output, shape, sampling ids, start, duration, kv use)
    copy_free_at: float = 0.0  # when the host<->device copy engine is next free


class Simulation:
    def __init__(
        self,
        items: list[TraceItem],
        config: SimConfig,
        cost_model: CostModel | None = None,
        profile: dict | None = None,
    ):
        self.config = config
        self.profile = profile if profile is not None else load_profile(config.profile)
        self.cost = cost_model or CostModel.from_profile(self.profile)
        self.items = items
        self.block_size = config.block_size or self.profile.get("block_size") or 16
        self.swap_s_per_block = (
            self.block_size
            * kv_bytes_per_token(config, self.profile)
            / (config.swap_bandwidth_gbs * 1e9)
        )
        self.attn_s = prefill_attention_coeff(config, self.profile)
        if config.clock not in ("measured", "fit"):
            raise ValueError(f"clock must be 'measured' or 'fit', got {config.clock!r}")
        self._clock = (
            self.cost.measured_time if config.clock == "measured" else self.cost.iteration_time
        )
        self.executors = [self._make_executor(str(i)) for i in range(config.num_executors)]
        self.by_name = {e.name: e for e in self.executors}
        self.requests: dict[str, Request] = {}
        self.iterations: list[IterationRecord] = []
        self.finish_count: dict[str, int] = {}
        self.now = 0.0
        self._heap: list[tuple] = []
        self._seq = itertools.count()
        self.forecasts: ForecastSource | None = None  # set by `run` from the prediction spec
        # request id -> the key forecasts are looked up by (sample id, else request id)
        self.keys = {i.request_id: i.sample_id or i.request_id for i in items}

    def _make_executor(self, name: str) -> Executor:
        dev = self.config.num_device_blocks or self.profile.get("num_device_blocks")
        if not dev:
            raise ValueError(
                "the profile has no num_device_blocks: set SimConfig.num_device_blocks"
            )
        host = self.config.num_host_blocks
        if host is None:
            host = self.profile.get("num_host_blocks", dev)
        policy = make_policy(self.config.policy, **self.config.knobs)
        bm = BlockManager(
            int(dev),
            int(host),
            int(self.block_size),
            enable_prefix_caching=self.config.prefix_caching,
            cache_salt="sim",
        )
        return Executor(name, Scheduler(policy, bm, self.cost, self.config.max_model_len))

    # -- events ---------------------------------------------------------------------------
    def _push(self, time: float, kind: int, payload) -> None:
        heapq.heappush(self._heap, (time, kind, next(self._seq), payload))

    def _make_request(self, item: TraceItem, predicted: int, source: str) -> Request:
        """With forecasts the request is sent with the deployment's cap as max_tokens (the
        length limit) and ends on an EOS at its true length, so that neither max_tokens nor
        anything else tells the scheduler its length; without, max_tokens = its length."""
        slo = Slo(item.slo.ttft_s, item.slo.tbt_s, item.slo.deadline_s)
        cap, true_len = item.output_len, item.output_len
        if self.forecasts is not None:
            cap = self.config.max_model_len - item.prompt_len
            true_len = min(true_len, cap)
        return Request(
            item.request_id,
            prompt_tokens(item),
            cap,
            item.arrival_s,
            eos_token_ids=(EOS_TOKEN,),
            ignore_eos=self.forecasts is None,
            slo=slo,
            predicted_len=predicted,
            prediction_source=source,
            true_len=true_len,
            max_model_len=self.config.max_model_len,
        )

    def run(self) -> Simulation:
        arrival, forecast = split_spec(self.config.prediction)
        self.forecasts = make_forecasts(forecast, self.config.seed)
        lengths, source = predict_lengths(self.items, arrival, self.config.seed)
        for item, predicted in zip(self.items, lengths):
            if item.prompt_len + 1 > self.config.max_model_len:
                raise ValueError(
                    f"{item.request_id}: prompt of {item.prompt_len} tokens does "
                    f"not fit max_model_len={self.config.max_model_len}"
                )
            self._push(item.arrival_s, ARRIVAL, self._make_request(item, predicted, source))
        while self._heap:
            self.now = self._heap[0][0]
            while self._heap and self._heap[0][0] == self.now:
                _, kind, _, payload = heapq.heappop(self._heap)
                self._handle(kind, payload)
            for ex in self.executors:
                if not ex.busy:
                    self._start_step(ex)
        self._check_done()
        return self

    def _handle(self, kind: int, payload) -> None:
        if kind == ARRIVAL:
            self._arrive(payload)
        elif kind == STEP_END:
            self._end_step(self.by_name[payload])
        # SWAP_DONE only advances the clock: its completion time is in the iteration record

    def _arrive(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if len(self.executors) == 1:
            target = self.executors[0].name
        else:
            from services.scheduler.core.placement import choose_executor

            target = choose_executor(
                {e.name: e.scheduler for e in self.executors},
                req,
                self.now,
                self.config.cache_aware_placement,
            )
            if target is None:
                raise SimulationError(
                    f"no executor can ever hold {req.request_id} "
                    f"({req.num_prompt_tokens} prompt tokens)"
                )
        self.by_name[target].scheduler.admit(req)

    # -- steps ----------------------------------------------------------------------------
    def _start_step(self, ex: Executor) -> None:
        sched = ex.scheduler
        if not sched.has_unfinished:
            return
        out = sched.schedule(self.now)
        swaps = len(out.swap_out) + len(out.swap_in)
        if not out.num_scheduled_tokens and not swaps:
            return  # nothing runnable now; a later arrival or step end wakes it
        reqs = sched.requests
        sampling = [
            rid
            for rid, n in out.num_scheduled_tokens.items()
            if reqs[rid].num_computed_tokens + n >= reqs[rid].num_tokens
        ]
        shape = sched.last_shape
        compute = self._clock(
            shape.num_prefill_tokens, shape.num_decode_tokens, shape.num_context_tokens
        )
        if self.attn_s:
            compute += self.attn_s * sum(
                n * (reqs[rid].num_computed_tokens + (n + 1) / 2)
                for rid, n in out.num_scheduled_tokens.items()
                if n > 1
            )
        duration = compute + self._swap_time(ex, swaps, compute)
        ex.busy = True
        kv_util = sched.block_manager.device_utilization
        ex.step = (out, shape, sampling, self.now, duration, kv_util)
        self._push(self.now + duration, STEP_END, ex.name)

    def _swap_time(self, ex: Executor, blocks: int, compute: float) -> float:
        """Extra step time the swaps add beyond the forward pass."""
        if not blocks:
            return 0.0
        start = max(self.now, ex.copy_free_at)
        ex.copy_free_at = start + blocks * self.swap_s_per_block
        self._push(ex.copy_free_at, SWAP_DONE, ex.name)
        if self.config.overlap_swaps:
            return max(0.0, ex.copy_free_at - self.now - compute)
        return ex.copy_free_at - self.now

    def _end_step(self, ex: Executor) -> None:
        out, shape, sampling, start, duration, kv_util = ex.step
        ex.busy, ex.step = False, None
        outcome = self._outcome(ex, out.step_id, sampling, duration)
        for update in ex.scheduler.update(outcome, self.now):
            if update.finished:
                self.finish_count[update.request_id] = (
                    self.finish_count.get(update.request_id, 0) + 1
                )
        self._record(ex, out, shape, start, kv_util)
        if len(self.iterations) > self.config.max_iterations:
            raise SimulationError(
                f"more than {self.config.max_iterations} iterations: "
                f"policy {self.config.label} does not finish its work"
            )

    def _outcome(self, ex: Executor, step_id: int, sampling: list[str], t: float) -> StepOutcome:
        """Dummy tokens (EOS at a request's true length when it is not told by max_tokens),
        and the forecasts of the requests at a checkpoint after this step."""
        outcome = StepOutcome(step_id, {rid: (DUMMY_TOKEN, 0.0) for rid in sampling}, t)
        source = self.forecasts
        if source is None:
            return outcome
        reqs = ex.scheduler.requests
        for rid in sampling:
            req = reqs[rid]
            generated = req.num_output_tokens + 1  # with this step's token
            true_len = req.true_len or req.max_tokens
            if generated == true_len < req.max_tokens:
                outcome.sampled[rid] = (EOS_TOKEN, 0.0)
                continue
            fc = source.at(self.keys[rid], generated, true_len, req.max_tokens)
            if fc is not None:
                outcome.forecasts[rid] = fc
        return outcome

    def _record(
        self, ex: Executor, out: SchedulerOutput, shape: StepShape, start: float, kv_util: float
    ) -> None:
        self.iterations.append(
            IterationRecord(
                start,
                self.now,
                shape.num_prefill_tokens,
                shape.num_decode_tokens,
                kv_util,
                token_budget=shape.token_budget,
                num_requests=len(out.num_scheduled_tokens),
                num_preempted=len(shape.preempted_request_ids),
                num_swap_out_blocks=len(out.swap_out),
                num_swap_in_blocks=len(out.swap_in),
                executor=ex.name,
            )
        )

    def _check_done(self) -> None:
        stuck = [e for e in self.executors if e.scheduler.has_unfinished]
        if stuck:
            s = stuck[0].scheduler
            raise SimulationError(
                f"policy {self.config.label} stalled at t={self.now:.3f}s with work left on "
                f"executor {stuck[0].name}: waiting={s.num_waiting} running={s.num_running} "
                f"swapped={s.num_swapped}, free device blocks="
                f"{s.block_manager.num_free_device_blocks}"
            )
