"""`sarathi`: Sarathi-Serve stall-free batching (Algorithm 3) with chunked prefills.

Every step, within a token budget tau: (1) every running decode gets its token, (2) ongoing
prefills get the next chunk that fits, (3) new requests are admitted in arrival order, chunked to
the leftover budget, while their KV fits. tau is `token_budget` when given, else the largest
batch whose cost-model iteration time meets `tbt_slo_s`, rounded down to `tile_size`
(section 4.3). KV shortage preempts the newest running request (vLLM's mechanism).

Table 4 ablations (each technique alone):
  * `chunked_prefill=False` ("hybrid-batching-only"): prompts are not chunked. Decodes still
    go first and new prompts join the same batch whole, in arrival order, while they fit the
    leftover budget; the first prompt of a step is taken whole even when it alone is longer
    than what is left of tau (the step then exceeds tau: the generation stall the paper
    measures). Later prompts of that step wait (head-of-line, as in Orca).
  * `hybrid_batching=False` ("chunked-prefills-only"): a step holds prefill chunks or decodes,
    never both. Rule: steps alternate; after a step that ran decodes (or at start) the next
    one is a prefill step (ongoing chunks, chunked admissions and swapped-in partial prompts,
    all within tau), after a prefill step the next one is a decode step (every running decode,
    swapped decodes back). A step whose turn has nothing to run takes the other kind instead,
    so neither side idles while the other has work (Sarathi-Serve's simple-chunking baseline
    behaves the same way).
  * both False would be neither technique: rejected; that baseline is `fcfs` (vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import (
    KnobError,
    Knobs,
    Policy,
    PreemptionMode,
    register_policy,
)
from services.scheduler.core.policies.parts.budget import sarathi_budget
from services.scheduler.core.policies.parts.fifo import RUNNING, newest_first, schedule_or_preempt

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import SchedulerView


@dataclass(frozen=True)
class SarathiKnobs(Knobs):
    token_budget: int | None = None  # tau; None: derived from tbt_slo_s, else 512
    tbt_slo_s: float | None = None  # TBT target used to derive tau with the cost model
    tile_size: int = 128  # tau is rounded down to a multiple of this
    max_num_seqs: int = 256
    watermark: float = 0.01
    preemption_mode: PreemptionMode = "recompute"
    chunked_prefill: bool = True  # False: whole prompts ("hybrid-batching-only")
    hybrid_batching: bool = True  # False: prefill-only or decode-only steps

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, value in (
            ("chunked_prefill", self.chunked_prefill),
            ("hybrid_batching", self.hybrid_batching),
        ):
            if not isinstance(value, bool):
                raise KnobError(f"{key} must be true or false, got {value!r}")
        if not self.chunked_prefill and not self.hybrid_batching:
            raise KnobError(
                "chunked_prefill=false with hybrid_batching=false leaves "
                "neither Sarathi-Serve technique; use the `fcfs` policy (vLLM: "
                "whole-prompt prefill-only steps, else decode-only steps)"
            )


@register_policy("sarathi")
class SarathiPolicy(Policy):
    knobs_type = SarathiKnobs
    knobs: SarathiKnobs
    # set by `bind`
    budget: int  # tau, tokens per step
    seqs: int  # requests per step
    last_was_prefill: bool  # kind of the previous step (hybrid_batching=False)

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        k = self.knobs
        self.budget = sarathi_budget(k.token_budget, k.tbt_slo_s, k.tile_size, sched.cost_model)
        self.seqs = min(k.max_num_seqs, self.budget)
        self.last_was_prefill = False

    def schedule(self, now: float) -> SchedulerOutput:
        b = self.sched.new_batch(now, self.budget)
        victims = newest_first(self.sched.running)
        if self.knobs.hybrid_batching:
            self._decodes(b, victims)
            self._ongoing_prefills(b, victims)
            if not b.preempted:
                self._swap_back(b)
                self._admit(b)
            return b.finish()
        turns: tuple[Callable[[Batch, Iterator[Request]], None], ...]
        turns = (self._prefill_step, self._decode_step)
        if self.last_was_prefill:
            turns = turns[::-1]
        for turn in turns:
            turn(b, victims)
            if b.scheduled:
                self.last_was_prefill = turn == self._prefill_step
                break
        return b.finish()

    # -- step kinds (hybrid_batching=False) -------------------------------------------------
    def _prefill_step(self, b: Batch, victims: Iterator[Request]) -> None:
        self._ongoing_prefills(b, victims)
        if not b.preempted:
            self._swap_back(b, prefills=True)
            self._admit(b)

    def _decode_step(self, b: Batch, victims: Iterator[Request]) -> None:
        self._decodes(b, victims)
        if not b.preempted:
            self._swap_back(b, prefills=False)

    # -- pieces -----------------------------------------------------------------------------
    def _decodes(self, b: Batch, victims: Iterator[Request]) -> None:
        for req in list(self.sched.running.values()):
            if req.num_uncomputed_tokens == 1:
                if b.num_seqs >= self.seqs or b.tokens_left < 1:
                    break
                schedule_or_preempt(b, req, 1, victims, self.knobs.preemption_mode)

    def _ongoing_prefills(self, b: Batch, victims: Iterator[Request]) -> None:
        for req in list(self.sched.running.values()):
            if (
                req.status is RUNNING
                and req.num_uncomputed_tokens > 1
                and req.request_id not in b.scheduled
            ):
                n = self._chunk(b, req)
                if n < 1 or b.num_seqs >= self.seqs:
                    break
                if schedule_or_preempt(b, req, n, victims, self.knobs.preemption_mode):
                    b.cover()

    def _admit(self, b: Batch) -> None:
        """New requests in arrival order while they fit (stop at the first that does not)."""
        s = self.sched
        for req in list(s.waiting.values()):
            if len(s.running) >= self.seqs or b.num_seqs >= self.seqs:
                break
            n = self._chunk(b, req)
            if n < 1 or not b.schedule(req, n, self.watermark_blocks):
                break
            b.cover()

    def _chunk(self, b: Batch, req: Request) -> int:
        """Tokens to give `req` now: the next chunk that fits the leftover budget, or with
        chunked_prefill=False its whole remaining prompt, which may exceed the leftover budget
        only as the step's first prefill (0: it waits)."""
        need = req.num_uncomputed_tokens
        if self.knobs.chunked_prefill or need == 1:
            return min(need, b.tokens_left)
        if need <= b.tokens_left or not any(n > 1 for n in b.scheduled.values()):
            return need
        return 0

    def _swap_back(self, b: Batch, prefills: bool | None = None) -> None:
        """Swapped requests back in order while their KV fits; `prefills` True/False limits
        it to partial prompts / decodes (for prefill-only and decode-only steps)."""
        bm = self.sched.block_manager
        for req in list(self.sched.swapped.values()):
            if prefills is not None and (req.num_uncomputed_tokens > 1) != prefills:
                continue
            n = self._chunk(b, req)
            if n < 1 or b.num_seqs >= self.seqs:
                break
            need = bm.num_swap_in_blocks(req, n)
            if need > bm.num_free_device_blocks or not b.swap_in(req):
                break
            b.schedule(req, n)
            b.cover()
