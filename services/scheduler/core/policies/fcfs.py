"""`fcfs`: vLLM (v0) iteration-level FCFS, prefill-prioritising.

Each step is either prefill-only (whole prompts, in arrival order, while they fit the token
budget, the batch size and the KV pool above the watermark) or decode-only (every running
request gets one token; when KV runs out the newest running request is preempted, by
recompute by default). Swapped requests come back, in order, before any new admission.
"""
from __future__ import annotations

from services.scheduler.core.policies.base import Policy, register_policy
from services.scheduler.core.policies.common import (
    RUNNING, admit_fcfs, newest_first, schedule_or_preempt)


@register_policy("fcfs")
class FcfsPolicy(Policy):
    KNOBS = {
        "max_num_seqs": 256,               # batch size limit
        "max_num_batched_tokens": None,    # token limit per step; None: max(2048, max_model_len)
        "watermark": 0.01,                 # fraction of device blocks kept free at admission
        "preemption_mode": "recompute",    # or "swap"
    }

    def bind(self, sched) -> None:
        super().bind(sched)
        self.budget = self.max_num_batched_tokens or max(2048, sched.max_model_len)
        if self.budget < sched.max_model_len:
            raise ValueError(f"fcfs: max_num_batched_tokens={self.budget} is below "
                             f"max_model_len={sched.max_model_len}; whole prompts would not fit")
        self.seqs = min(self.max_num_seqs, self.budget)

    def schedule(self, s, now):
        b = s.new_batch(now, self.budget)
        if not s.swapped:
            admit_fcfs(b, s.waiting, self.seqs, self.watermark_blocks)
            if b.scheduled:
                return b.finish()
        self.decode_running(s, b)
        if not b.preempted:
            self.swap_back(s, b)
        return b.finish()

    def decode_running(self, s, b) -> None:
        victims = newest_first(s.running)
        for req in list(s.running.values()):
            if req.status is not RUNNING or req.request_id in b.scheduled:
                continue
            if b.num_seqs >= self.seqs or b.tokens_left < 1:
                break
            n = min(req.num_uncomputed_tokens, b.tokens_left)
            schedule_or_preempt(b, req, n, victims, self.preemption_mode)

    def swap_back(self, s, b) -> None:
        for req in list(s.swapped.values()):
            if len(s.running) >= self.seqs or b.tokens_left < 1:
                break
            need = s.block_manager.num_host_blocks_of(req.request_id) + 1
            if need > s.block_manager.num_free_device_blocks:
                break
            b.swap_in(req)
            b.schedule(req, min(req.num_uncomputed_tokens, b.tokens_left))
