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

from services.scheduler.core.policies.base import Policy, register_policy
from services.scheduler.core.policies.common import (
    RUNNING, newest_first, schedule_or_preempt)

DEFAULT_TOKEN_BUDGET = 512   # Sarathi-Serve's 'strict' setting


def sarathi_budget(policy, sched) -> int:
    """token_budget knob, else from the TBT target via the cost model, else 512."""
    if policy.token_budget:
        return policy.token_budget
    if policy.tbt_slo_s:
        return sched.cost_model.token_budget(policy.tbt_slo_s, policy.tile_size)
    return DEFAULT_TOKEN_BUDGET


@register_policy("sarathi")
class SarathiPolicy(Policy):
    KNOBS = {
        "token_budget": None,          # tau; None: derived from tbt_slo_s, else 512
        "tbt_slo_s": None,             # TBT target used to derive tau with the cost model
        "tile_size": 128,              # tau is rounded down to a multiple of this
        "max_num_seqs": 256,
        "watermark": 0.01,
        "preemption_mode": "recompute",
        "chunked_prefill": True,       # False: whole prompts ("hybrid-batching-only")
        "hybrid_batching": True,       # False: prefill-only or decode-only steps
    }

    def validate(self) -> None:
        super().validate()
        for key in ("chunked_prefill", "hybrid_batching"):
            if not isinstance(self.knobs[key], bool):
                raise ValueError(f"sarathi: {key} must be true or false, got {self.knobs[key]!r}")
        if not self.chunked_prefill and not self.hybrid_batching:
            raise ValueError("sarathi: chunked_prefill=false with hybrid_batching=false leaves "
                             "neither Sarathi-Serve technique; use the `fcfs` policy (vLLM: "
                             "whole-prompt prefill-only steps, else decode-only steps)")

    def bind(self, sched) -> None:
        super().bind(sched)
        self.budget = sarathi_budget(self, sched)
        self.seqs = min(self.max_num_seqs, self.budget)
        self.last_was_prefill = False   # kind of the previous step (hybrid_batching=False)

    def schedule(self, s, now):
        b = s.new_batch(now, self.budget)
        victims = newest_first(s.running)
        if self.hybrid_batching:
            self._decodes(s, b, victims)
            self._ongoing_prefills(s, b, victims)
            if not b.preempted:
                self._swap_back(s, b)
                self._admit(s, b)
            return b.finish()
        turns = (self._prefill_step, self._decode_step)
        if self.last_was_prefill:
            turns = turns[::-1]
        for turn in turns:
            turn(s, b, victims)
            if b.scheduled:
                self.last_was_prefill = turn == self._prefill_step
                break
        return b.finish()

    # -- step kinds (hybrid_batching=False) -------------------------------------------------
    def _prefill_step(self, s, b, victims) -> None:
        self._ongoing_prefills(s, b, victims)
        if not b.preempted:
            self._swap_back(s, b, prefills=True)
            self._admit(s, b)

    def _decode_step(self, s, b, victims) -> None:
        self._decodes(s, b, victims)
        if not b.preempted:
            self._swap_back(s, b, prefills=False)

    # -- pieces -----------------------------------------------------------------------------
    def _decodes(self, s, b, victims) -> None:
        for req in list(s.running.values()):
            if req.num_uncomputed_tokens == 1:
                if b.num_seqs >= self.seqs or b.tokens_left < 1:
                    break
                schedule_or_preempt(b, req, 1, victims, self.preemption_mode)

    def _ongoing_prefills(self, s, b, victims) -> None:
        for req in list(s.running.values()):
            if req.status is RUNNING and req.num_uncomputed_tokens > 1 and req.request_id not in b.scheduled:
                n = self._chunk(b, req)
                if n < 1 or b.num_seqs >= self.seqs:
                    break
                if schedule_or_preempt(b, req, n, victims, self.preemption_mode):
                    self._cover(b)

    def _admit(self, s, b) -> None:
        """New requests in arrival order while they fit (stop at the first that does not)."""
        for req in list(s.waiting.values()):
            if len(s.running) >= self.seqs or b.num_seqs >= self.seqs:
                break
            n = self._chunk(b, req)
            if n < 1 or not b.schedule(req, n, self.watermark_blocks):
                break
            self._cover(b)

    def _chunk(self, b, req) -> int:
        """Tokens to give `req` now: the next chunk that fits the leftover budget, or with
        chunked_prefill=False its whole remaining prompt, which may exceed the leftover budget
        only as the step's first prefill (0: it waits)."""
        need = req.num_uncomputed_tokens
        if self.chunked_prefill or need == 1:
            return min(need, b.tokens_left)
        if need <= b.tokens_left or not any(n > 1 for n in b.scheduled.values()):
            return need
        return 0

    @staticmethod
    def _cover(b) -> None:
        """A whole prompt past tau raises this step's budget to what it holds, so the output
        reports the budget it was really packed against (and nothing else joins)."""
        if b.token_budget is not None and b.num_tokens > b.token_budget:
            b.token_budget = b.num_tokens

    def _swap_back(self, s, b, prefills: bool | None = None) -> None:
        """Swapped requests back in order while their KV fits; `prefills` True/False limits
        it to partial prompts / decodes (for prefill-only and decode-only steps)."""
        bm = s.block_manager
        for req in list(s.swapped.values()):
            if prefills is not None and (req.num_uncomputed_tokens > 1) != prefills:
                continue
            n = self._chunk(b, req)
            if n < 1 or b.num_seqs >= self.seqs:
                break
            need = max(bm.num_host_blocks_of(req.request_id),
                       bm.blocks_for_tokens(req.num_computed_tokens + n))
            if need > bm.num_free_device_blocks or not b.swap_in(req):
                break
            b.schedule(req, n)
            self._cover(b)
