"""`Scheduler`: one per executor. Owns the request records, the three queues and the block
manager; the policy decides, this applies. Pure and deterministic given inputs and `now`.

Life of a step:  out = schedule(now)  ->  executor runs `out`  ->  update(outcome, now).
At most `pipeline_depth` steps are in flight (1: the simulator; 2: the live scheduler, which
plans step n+1 while the executor runs step n). Planning ahead counts the running step's tokens
as computed and gives every request it samples for a pending token (`num_pending_tokens`), so the
next plan computes that token (done by the next `schedule()` while the step is in flight, or
by its `update()`, so a step is applied exactly as without pipelining when none is planned
ahead of it); `update()` applies the steps' results in order, replacing each
pending token by the sampled one. A request that finishes (stop token) while a later step is
in flight was given one more token there: that surplus token is discarded, and its free goes
out in the next plan. A request whose pending tokens certainly finish it by length is given
nothing more (`Request.ends_with_pending`).

`requests` holds every unfinished request. A finished one stays until the output carrying its
free is acknowledged, i.e. at that step's `update()` or the next `schedule()` with no step in
flight (a free-only output is never in flight), then it is dropped; one the executor never saw
is dropped when it finishes. So memory stays bounded in a long-running server, and a caller
whose step failed can still find the requests whose free may not have reached the executor.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.step import RequestUpdate, SchedulerOutput, StepOutcome
from services.scheduler.core.batch import Batch
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.request import FINISH_REASON_STATUS, Request, RequestStatus
from services.scheduler.core.shape import StepShape
from services.scheduler.core.view import AppliedStep

if TYPE_CHECKING:
    from services.scheduler.core.policies.base import Policy

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED


@dataclass
class _InFlight:
    """A step sent and not yet updated; `sampling`: the requests it samples a token for, set
    once the step is advanced (see `Scheduler._advance`)."""

    out: SchedulerOutput
    shape: StepShape
    sampling: list[str] | None = None


class Scheduler:
    def __init__(
        self,
        policy: Policy | str,
        block_manager: BlockManager,
        cost_model: CostModel,
        max_model_len: int,
    ) -> None:
        from services.scheduler.core.policies import make_policy

        if isinstance(policy, str):
            policy = make_policy(policy)
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.policy = policy
        self.block_manager = block_manager
        self.cost_model = cost_model
        # a lone request must always fit the device pool, or it could never finish
        pool_tokens = block_manager.num_device_blocks * block_manager.block_size
        self.max_model_len = min(max_model_len, pool_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: OrderedDict[str, Request] = OrderedDict()  # resident on device
        self.swapped: OrderedDict[str, Request] = OrderedDict()
        self._sent: set[str] = set()  # requests the executor holds state for
        self._pending_free: list[str] = []  # finished and known: freed in the next output
        # (step id, ids) freed in outputs sent: dropped once that output is acknowledged
        self._freed_sent: deque[tuple[int, list[str]]] = deque()
        # steps sent and not yet updated, oldest first, each with the requests it samples for
        # once advanced (None before: see _advance)
        self._inflight: deque[_InFlight] = deque()
        self.pipeline_depth = 1  # steps that may be in flight at once
        self._step_id = 0
        self._last_step_id = 0
        self.num_finished = 0
        self.num_preemptions = 0
        self._batches: list[Batch] = []  # made by the policy while it builds a step
        self.last_shape = StepShape()  # what the core knows of the last step it built
        policy.bind(self)
        # ...and it must still fit when the admission watermark is kept free
        reserve = getattr(policy, "watermark_blocks", 0)
        if reserve:
            usable = (block_manager.num_device_blocks - reserve) * block_manager.block_size
            self.max_model_len = min(self.max_model_len, max(2, usable))

    # -- requests ---------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        """Queue `req`. It must be WAITING with nothing computed. It may already carry output
        (re-admitted after a scheduler restart or an executor failure): the policy's `on_add`
        then sees that output (ALISE doubles an outgrown prediction, hybrid skips the TTFT
        queue), and prompt + output are recomputed and sent together in `new_requests`
        (`num_output_tokens` set). With prefix caching, its longest cached prefix of full
        blocks is counted as computed (`num_cached_tokens`)."""
        rid = req.request_id
        if rid in self.requests and not self.requests[rid].is_finished:
            raise ValueError(f"request {rid} already exists")
        if req.status is not WAITING or req.num_computed_tokens:
            raise ValueError(
                f"request {rid} must be waiting with nothing computed, got status="
                f"{req.status.value} num_computed_tokens={req.num_computed_tokens}"
            )
        n_out = req.num_output_tokens
        if n_out >= req.max_tokens:
            raise ValueError(
                f"request {rid} already has {n_out} output tokens "
                f"(max_tokens={req.max_tokens}): nothing left to generate"
            )
        limit = self.length_limit(req)
        if req.num_tokens + 1 > limit:
            what = f"prompt of {req.num_prompt_tokens} tokens" + (
                f" + {n_out} output tokens" if n_out else ""
            )
            raise ValueError(
                f"request {rid}: {what} leaves no room to generate within max_model_len={limit}"
            )
        req.max_model_len = limit
        # prefix caching: the cached prefix counts as computed from now on (attached when the
        # request is first scheduled), so the policy's estimates see only the uncached rest
        cached = self.block_manager.cached_prefix_len(req)
        req.num_computed_tokens = req.num_cached_tokens = cached
        self.requests[rid] = req
        self.waiting[rid] = req
        self.policy.on_add(req, req.arrival_time)

    def can_admit(self, req: Request) -> bool:
        """Whether `admit(req)` would accept `req`'s length: its known tokens (prompt, plus the
        output of a re-admitted request) and one more fit, and max_tokens is not reached."""
        return (
            req.num_tokens + 1 <= self.length_limit(req) and req.num_output_tokens < req.max_tokens
        )

    def length_limit(self, req: Request) -> int:
        """The most tokens (prompt + output) `req` may reach on this executor."""
        own = req.max_model_len
        return self.max_model_len if own is None else min(own, self.max_model_len)

    def abort(self, request_id: str, now: float) -> bool:
        """Finish an unfinished request as aborted; False when there is none by that id."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, "abort", now)
        return True

    # -- step -------------------------------------------------------------------------------
    def new_batch(self, now: float, token_budget: int | None = None) -> Batch:
        batch = Batch(self, now, token_budget)
        self._batches.append(batch)
        return batch

    def schedule(self, now: float) -> SchedulerOutput:
        if len(self._inflight) >= self.pipeline_depth:
            step = self._inflight[-1].out.step_id
            raise RuntimeError(f"step {step} is still in flight; update() first")
        if not self._inflight:
            self._drop_freed()
        for flight in self._inflight:  # planning ahead: build on the steps in flight
            if flight.sampling is None:
                flight.sampling = self._advance(flight.out)
        self.block_manager.begin_step()
        self._batches = []
        out = self.policy.schedule(now)
        shape = next((b.shape for b in self._batches if b.output is out), None)
        self._batches = []
        if shape is None:
            raise RuntimeError(f"{type(self.policy).__name__} returned a step it did not build")
        self.last_shape = shape
        self._step_id += 1
        out.step_id = self._step_id
        if self._pending_free:
            out.free_request_ids = self._pending_free + out.free_request_ids
            self._freed_sent.append((out.step_id, self._pending_free))
            self._pending_free = []
        self.num_preemptions += len(shape.preempted_request_ids)
        # only steps that compute or move KV need their result applied; an output that merely
        # frees requests may be sent (update() accepts it as a no-op) or dropped by the caller
        if out.num_scheduled_tokens or out.swap_out or out.swap_in:
            self._inflight.append(_InFlight(out, shape))
        self._last_step_id = out.step_id
        return out

    def _advance(self, out: SchedulerOutput) -> list[str]:
        """Count the step's tokens as computed (the next plan builds on them); each request
        the step samples a token for gets a pending token. Returns those requests."""
        reqs = self.requests
        sampling = []
        for rid, n in out.num_scheduled_tokens.items():
            req = reqs.get(rid)
            if req is None or req.is_finished:
                continue  # aborted since: nothing of it is applied
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.num_pending_tokens += 1
                sampling.append(rid)
        return sampling

    def update(self, outcome: StepOutcome, now: float) -> list[RequestUpdate]:
        """Apply the oldest step in flight's result (or acknowledge a free-only output)."""
        inflight = self._inflight
        if not inflight and outcome.step_id == self._last_step_id:
            self._drop_freed(outcome.step_id)
            return []  # a step that only freed requests: nothing to apply
        if not inflight or outcome.step_id != inflight[0].out.step_id:
            expected = inflight[0].out.step_id if inflight else None
            raise ValueError(f"outcome for step {outcome.step_id}, expected step {expected}")
        flight = inflight.popleft()
        out = flight.out
        sampling = flight.sampling if flight.sampling is not None else self._advance(out)
        self._drop_freed(out.step_id)
        reqs = self.requests
        if self.block_manager.cache is not None:
            commit = self.block_manager.commit
            for rid in out.num_scheduled_tokens:
                req = reqs.get(rid)
                if req is not None and not req.is_finished:
                    commit(req)  # blocks now full of computed tokens become cacheable
        updates: list[RequestUpdate] = []
        sampled = outcome.sampled
        for rid in sampling:
            req = reqs.get(rid)
            if req is None or req.is_finished:
                continue  # aborted, or finished by an earlier step: its token is surplus
            tok = sampled.get(rid)
            if tok is None:
                raise ValueError(f"step {out.step_id}: executor sampled no token for {rid}")
            req.num_pending_tokens -= 1
            updates.append(self._append_token(req, tok[0], tok[1], now))
        for rid, forecast in outcome.forecasts.items():
            req = reqs.get(rid)
            if req is not None and not req.is_finished:
                req.forecast = forecast  # the policy's update below ranks by it
        self.policy.update(AppliedStep(out, flight.shape, outcome, updates), now)
        return updates

    def _append_token(self, req: Request, token: int, logprob: float, now: float) -> RequestUpdate:
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        req.token_times.append(now)
        index = len(req.output_token_ids) - 1
        reason = self._stop_reason(req, token, req.max_model_len or self.max_model_len)
        if reason is not None:
            self._finish(req, reason, now)
        return RequestUpdate(req.request_id, (token, logprob, index), reason is not None, reason)

    @staticmethod
    def _stop_reason(req: Request, token: int, limit: int) -> str | None:
        n = len(req.output_token_ids)
        if n >= req.min_tokens and (
            token in req.stop_token_ids or (not req.ignore_eos and token in req.eos_token_ids)
        ):
            return "stop"
        if n >= req.max_tokens or req.num_known_tokens >= limit:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, now: float) -> None:
        rid = req.request_id
        self._dequeue(req)
        req.status = FINISH_REASON_STATUS[reason]
        req.finish_reason = reason
        req.finished_time = now
        req.num_pending_tokens = 0  # a later step in flight computes a surplus token: dropped
        self.block_manager.free(rid)
        if self.forget(rid):
            self._pending_free.append(rid)
        elif self.requests.get(rid) is req:
            del self.requests[rid]  # the executor never saw it: nothing to free
        self.num_finished += 1
        self.policy.on_finish(req, now)

    def _drop_freed(self, upto: int | None = None) -> None:
        """Forget finished requests whose free went out in an acknowledged output (every
        output up to step `upto`; all of them when None)."""
        reqs, sent = self.requests, self._freed_sent
        while sent and (upto is None or sent[0][0] <= upto):
            for rid in sent.popleft()[1]:
                req = reqs.get(rid)
                if req is not None and req.is_finished:  # not re-added under the same id
                    del reqs[rid]

    # -- queue moves and executor state (used by Batch) -----------------------------------
    def _queue(self, status: RequestStatus) -> OrderedDict[str, Request]:
        if status is RUNNING:
            return self.running
        return self.waiting if status is WAITING else self.swapped

    def _dequeue(self, req: Request) -> None:
        if not req.status.is_finished:
            self._queue(req.status).pop(req.request_id, None)

    def move(self, req: Request, status: RequestStatus) -> None:
        """Move an unfinished request to the queue of `status` (and tell the policy)."""
        self._queue(req.status).pop(req.request_id, None)
        req.status = status
        self._queue(status)[req.request_id] = req
        self.policy.on_move(req, status)

    def mark_sent(self, request_ids: Iterable[str]) -> set[str]:
        """The executor learns of `request_ids` in the step being built; returns the ones it
        did not know yet (they go out as new requests). One set operation per step."""
        fresh = set(request_ids) - self._sent
        self._sent |= fresh
        return fresh

    def forget(self, request_id: str) -> bool:
        """The executor drops its state of `request_id`; True if it held any (free it)."""
        if request_id in self._sent:
            self._sent.discard(request_id)
            return True
        return False

    # -- views ------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def predicted_len(self, req: Request) -> int:
        return self.policy.predicted_len(req)

    def prefix_saving(self, req: Request) -> float:
        """Predicted seconds of prefill this executor's prefix cache would save `req`, which
        is not admitted here (0 without caching): cache-aware placement subtracts it."""
        cache = self.block_manager.cache
        if cache is None:
            return 0.0
        return cache.peek(req) * cache.block_size * self.cost_model.t0

    def outstanding_work(self, now: float) -> float:
        """Predicted seconds of execution left over every unfinished request (for placement)."""
        cm = self.cost_model
        total = 0.0
        for queue in (self.running, self.swapped, self.waiting):
            for req in queue.values():
                total += cm.remaining_time(req, self.policy.predicted_len(req))
        return total

    def stats(self) -> dict[str, int | float | str]:
        bm = self.block_manager
        return {
            "policy": self.policy.name,
            "steps": self._step_id,
            "waiting": len(self.waiting),
            "running": len(self.running),
            "swapped": len(self.swapped),
            "finished": self.num_finished,
            "preemptions": self.num_preemptions,
            "free_device_blocks": bm.num_free_device_blocks,
            "free_host_blocks": bm.num_free_host_blocks,
            "device_utilization": bm.device_utilization,
            "host_utilization": bm.host_utilization,
            **bm.cache_stats(),
        }
