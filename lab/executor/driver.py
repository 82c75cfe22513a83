"""A minimal in-process continuous-batching driver over an Engine (tests, benchmark, profiler).

Each step: running decodes first, then prefill chunks inside a token budget (Sarathi-style
stall-free batching), then new requests while blocks and batch slots last. Blocks for a
request's whole length (prompt + max tokens) are reserved on admission, so nothing is ever
preempted. The real scheduler lives in services/scheduler; this is the smallest loop that
keeps the engine busy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.arith import ceil_div
from services.common.sampling import SamplingParams
from services.common.step import NewRequestData, SchedulerOutput
from services.executor.messages import StepOutput

if TYPE_CHECKING:
    from services.executor.engine import Engine


@dataclass
class DriverSeq:
    """One request the driver runs: its prompt, and the tokens and logprobs it produced."""

    rid: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # (generated, feature vector) at each probe checkpoint (engines recording features)
    features: list = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.output)


class Driver:
    def __init__(self, engine: Engine, token_budget: int = 512, max_batch: int = 64) -> None:
        self.engine, self.budget, self.max_batch = engine, token_budget, max_batch
        self.free_blocks = list(range(engine.num_device_blocks - 1, -1, -1))
        self.steps = 0

    def _blocks_for(self, seq: DriverSeq) -> int:
        return ceil_div(len(seq.prompt) + seq.max_tokens, self.engine.block_size)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int | list[int],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        eos_ids: Iterable[int] = (),
    ) -> list[DriverSeq]:
        """Run prompts to completion; max_tokens and sampling are one for all or one per
        prompt. A request stops at max_tokens, or at an id in eos_ids (empty = ignore EOS)."""
        lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        params = (
            sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(lens)
        )
        seqs = [
            DriverSeq(f"r{i}", list(p), n, sp)
            for i, (p, n, sp) in enumerate(zip(prompts, lens, params, strict=True))
        ]
        waiting, running, to_free = list(seqs), [], []
        while waiting or running:
            step = SchedulerOutput(self.steps, free_request_ids=to_free)
            self._schedule(step, waiting, running)
            if not step.num_scheduled_tokens:
                raise RuntimeError("a request does not fit in the KV pool")
            out = self.engine.step(step)
            self.steps += 1
            to_free = self._update(out, running, set(eos_ids))
        if to_free:
            self.engine.step(SchedulerOutput(self.steps, free_request_ids=to_free))
        return seqs

    def _schedule(
        self, step: SchedulerOutput, waiting: list[DriverSeq], running: list[DriverSeq]
    ) -> None:
        budget = self.budget
        for seq in sorted(running, key=lambda s: s.computed < len(s.prompt)):  # decodes first
            n = min(seq.total - seq.computed, budget)
            if n > 0:
                step.num_scheduled_tokens[seq.rid] = n
                seq.computed += n
                budget -= n
        while waiting and budget > 0 and len(running) < self.max_batch:
            seq = waiting[0]
            need = self._blocks_for(seq)
            if need > len(self.free_blocks):
                break
            waiting.pop(0)
            seq.blocks = [self.free_blocks.pop() for _ in range(need)]
            step.new_requests.append(
                NewRequestData(seq.rid, seq.prompt, seq.sampling, max_tokens=seq.max_tokens)
            )
            step.block_tables[seq.rid] = (seq.blocks, False)
            n = min(len(seq.prompt), budget)
            step.num_scheduled_tokens[seq.rid] = n
            seq.computed += n
            budget -= n
            running.append(seq)

    def _update(self, out: StepOutput, running: list[DriverSeq], eos: set[int]) -> list[str]:
        done = []
        for seq in list(running):
            if seq.rid in out.probe_features:
                seq.features.append(out.probe_features[seq.rid])
            if seq.rid in out.sampled:
                tok, lp = out.sampled[seq.rid]
                seq.output.append(tok)
                seq.logprobs.append(lp)
                if len(seq.output) >= seq.max_tokens or tok in eos:
                    running.remove(seq)
                    self.free_blocks.extend(reversed(seq.blocks))
                    done.append(seq.rid)
        return done
