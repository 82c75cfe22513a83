"""`n` > 1 and `best_of`: several answers to one prompt.

Each answer is a generation of its own (its own scheduler key; a seeded request's answer i
uses seed + i). The prompt is prefilled once: the first generation goes alone, and its
siblings are submitted when it has produced its first token, by which time the prompt's full
blocks are in the executor's prefix cache (docs/scheduling.md, "Prefix caching") and
placement sends the siblings to that executor; each sibling computes only the prompt's last
partial block. A batched completion request (a list of prompts) gives each prompt its own
answers, its choices numbered prompt by prompt. `merged` interleaves the answers' pieces as
they come, tagged with the choice index; `best_of` keeps, per prompt, the `n` answers with
the highest cumulative log-probability.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

from services.common.pb import common_pb2
from services.gateway.generation import Generation, Piece, Plan
from services.gateway.middleware import new_request_id


def sibling_plans(plan: Plan, count: int) -> list[Plan]:
    """`plan` and `count - 1` copies with fresh request ids (and seed + i when seeded)."""
    plans = [plan]
    for i in range(1, count):
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(plan.sampling)
        if sampling.HasField("seed"):
            sampling.seed = (sampling.seed + i) % 2**64
        plans.append(replace(plan, request_id=new_request_id(), sampling=sampling))
    return plans


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece | None]]:
    """(choice index, piece) as the pieces come, and (index, None) when a choice ends. The
    first generation must have been started; the first of every other prompt starts at
    once, and the others of a prompt after its first's first piece (or its end). The first
    error ends everything (the caller closes every generation)."""
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()
    leaders: dict[int, int] = {}
    for i, gen in enumerate(gens):
        leaders.setdefault(gen.plan.prompt_index, i)
    primed = {i: asyncio.Event() for i in leaders.values()}

    async def pump(i: int, gen: Generation) -> None:
        leader = leaders[gen.plan.prompt_index]
        try:
            if i != leader:
                await primed[leader].wait()
            if i:
                await gen.start(None)
            async for piece in gen.pieces():
                if i == leader:
                    primed[i].set()
                await queue.put((i, piece))
            await queue.put((i, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))
        finally:
            if i == leader:
                primed[i].set()

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        for _ in range(len(gens)):
            while True:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield i, item
                if item is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def best(gens: list[Generation], n: int) -> list[Generation]:
    """Per prompt (in prompt order), the `n` answers with the highest cumulative
    log-probability, in that order."""
    prompts: dict[int, list[Generation]] = {}
    for gen in gens:
        prompts.setdefault(gen.plan.prompt_index, []).append(gen)
    return [
        g
        for group in prompts.values()
        for g in sorted(group, key=lambda g: g.cumulative_logprob, reverse=True)[:n]
    ]
