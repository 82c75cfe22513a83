"""`sarathi`: Sarathi-Serve stall-free batching (Algorithm 3) with chunked prefills.

Every step, within a token budget tau: (1) every running decode gets its token, (2) ongoing
prefills get the next chunk that fits, (3) new requests are admitted in arrival order, chunked to
the leftover budget, while their KV fits. tau is `token_budget` when given, else the largest
batch whose cost-model iteration time meets `tbt_slo_s`, rounded down to `tile_size`
(section 4.3). KV shortage preempts the newest running request (vLLM's mechanism).
"""
from __future__ import annotations

from services.scheduler.core.policies.base import Policy, register_policy
from services.scheduler.core.policies.common import (
    RUNNING, admit_fcfs, newest_first, schedule_or_preempt)

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
    }

    def bind(self, sched) -> None:
        super().bind(sched)
        self.budget = sarathi_budget(self, sched)
        self.seqs = min(self.max_num_seqs, self.budget)

    def schedule(self, s, now):
        b = s.new_batch(now, self.budget)
        victims = newest_first(s.running)
        for req in list(s.running.values()):       # decodes first
            if req.num_uncomputed_tokens == 1:
                if b.num_seqs >= self.seqs or b.tokens_left < 1:
                    break
                schedule_or_preempt(b, req, 1, victims, self.preemption_mode)
        for req in list(s.running.values()):       # then ongoing prefill chunks
            if req.status is RUNNING and req.num_uncomputed_tokens > 1 and req.request_id not in b.scheduled:
                n = min(req.num_uncomputed_tokens, b.tokens_left)
                if n < 1 or b.num_seqs >= self.seqs:
                    break
                schedule_or_preempt(b, req, n, victims, self.preemption_mode)
        if not b.preempted:
            self._swap_back(s, b)
            admit_fcfs(b, s.waiting, self.seqs, self.watermark_blocks, whole=False)
        return b.finish()

    def _swap_back(self, s, b) -> None:
        bm = s.block_manager
        for req in list(s.swapped.values()):
            n = min(req.num_uncomputed_tokens, b.tokens_left)
            if n < 1 or b.num_seqs >= self.seqs:
                break
            need = max(bm.num_host_blocks_of(req.request_id),
                       bm.blocks_for_tokens(req.num_computed_tokens + n))
            if need > bm.num_free_device_blocks or not b.swap_in(req):
                break
            b.schedule(req, n)
