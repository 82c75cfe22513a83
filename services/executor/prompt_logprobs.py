"""Prompt log-probabilities: OpenAI's completions `echo` with `logprobs`, vLLM's
`prompt_logprobs`. For each request that asks (`SamplingParams.prompt_logprobs`), every prompt
position its chunk computes gives the log-probability of the next prompt token under the raw
model distribution, with the most likely alternatives. Rows are turned into logits a slice
at a time, so a long prompt never holds [prompt, vocab] floats at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from services.executor.messages import RequestState
from services.executor.ragged_batch import StepBatch

ROWS_PER_SLICE = 256

# (token id, logprob, [(alternative id, logprob), ...] best first)
PromptEntry = tuple[int, float, list[tuple[int, float]]]


@dataclass
class PromptRows:
    """The rows of one request's chunk that predict prompt tokens."""

    request_id: str
    start: int  # prompt position of the first predicted token (>= 1)
    rows: list[int]  # packed batch rows, predicting positions start, start + 1, ...
    targets: list[int]  # the prompt tokens at those positions
    k: int  # alternatives per position


def prompt_rows(batch: StepBatch, requests: Mapping[str, RequestState]) -> list[PromptRows]:
    """For each run of a request asking prompt logprobs: its rows whose next token is still
    part of the prompt (a recompute's replayed output is not)."""
    out, offset = [], 0
    for run in batch.runs:
        state = requests[run.request_id]
        k = state.sampling.prompt_logprobs
        if k is not None:
            prompt_len = len(state.token_ids) - state.num_output_tokens
            first = run.ctx_before
            n = min(first + run.q_len, prompt_len - 1) - first
            if n > 0:
                targets = state.token_ids[first + 1 : first + 1 + n]
                rows = list(range(offset, offset + n))
                out.append(PromptRows(run.request_id, first + 1, rows, targets, k))
        offset += run.q_len
    return out


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    wanted: list[PromptRows],
) -> dict[str, tuple[int, list[PromptEntry]]]:
    """request id -> (start, entries) for the rows `wanted` of the step's hidden states."""
    out: dict[str, tuple[int, list[PromptEntry]]] = {}
    for w in wanted:
        entries: list[PromptEntry] = []
        for lo in range(0, len(w.rows), ROWS_PER_SLICE):
            rows = torch.tensor(w.rows[lo : lo + ROWS_PER_SLICE], device=hidden.device)
            targets = torch.tensor(w.targets[lo : lo + ROWS_PER_SLICE], device=hidden.device)
            logp = torch.log_softmax(logits_of(hidden[rows]).float(), dim=-1)
            chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
            top: list[list[tuple[int, float]]] = [[] for _ in chosen]
            if w.k:
                values, ids = logp.topk(w.k, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            entries.extend(zip(targets.tolist(), chosen, top))
        out[w.request_id] = (w.start, entries)
    return out
