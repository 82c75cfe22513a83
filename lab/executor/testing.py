"""Helpers that drive an Engine with hand-made step schedules (tests, quality measurements)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.common.arith import ceil_div
from services.common.step import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from services.executor.engine import Engine


def teacher_forced_logits(
    engine: Engine, prompts: list[list[int]], chunk_sizes: list[int | None], first_block: int = 0
) -> list[torch.Tensor]:
    """Feed every prompt through the engine in one mixed batch per step, request i advancing
    chunk_sizes[i] tokens a step (None = whole prompt at once). Returns per prompt the fp32
    logits [len, V] at every position. Requests are freed at the end."""
    bs = engine.block_size
    step = SchedulerOutput(0)
    next_block = first_block
    for i, ids in enumerate(prompts):
        n_blocks = ceil_div(len(ids), bs)
        step.new_requests.append(NewRequestData(f"tf{i}", list(ids)))
        step.block_tables[f"tf{i}"] = (list(range(next_block, next_block + n_blocks)), False)
        next_block += n_blocks
    done = [0] * len(prompts)
    parts: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        for i, ids in enumerate(prompts):
            if done[i] < len(ids):
                n = min(chunk_sizes[i] or len(ids), len(ids) - done[i])
                step.num_scheduled_tokens[f"tf{i}"] = n
                done[i] += n
        out = engine.step(step, all_logits=True)
        for rid, logits in out.logits.items():
            parts[int(rid[2:])].append(logits)
        step = SchedulerOutput(step.step_id + 1)
    engine.step(
        SchedulerOutput(step.step_id, free_request_ids=[f"tf{i}" for i in range(len(prompts))])
    )
    return [torch.cat(p) for p in parts]


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1]."""
    target = torch.tensor(ids[1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target)
    return float(torch.exp(nll))


def interpreted_checks(arg_lists: list[list[str]], timeout: float = 300) -> list[dict]:
    """interpreted_check of each argument list, all at once (the interpreter runs on one core:
    parts of one check in parallel use the others); their JSON objects, in order."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    threads = str(max(1, (os.cpu_count() or 1) // len(arg_lists)))  # no core oversubscribed
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=threads),
            cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in arg_lists
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def interpreted_check(args: list[str], timeout: float = 300) -> dict:
    """`python ARGS` (a lab check module) under Triton's interpreter from the repository
    root; the JSON object its last output line holds. Fails with its stderr's tail."""
    return interpreted_checks([args], timeout)[0]
