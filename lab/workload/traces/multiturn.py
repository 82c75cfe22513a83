"""Workloads that repeat themselves, for prefix caching: multi-turn chats and a shared system
prompt.

- `sharegpt_conversations`: ShareGPT conversations of the test split replayed turn by turn.
  Turn k's prompt is the history so far (user 0, reference answer 0, ..., user k) and its true
  output is reference answer k, so turn k's prompt extends turn k-1's. Token counts come from
  the serving model's tokenizer; a conversation stops before a turn whose prompt + answer would
  pass `max_total` tokens.
- `multiturn_trace`: conversations start as a Poisson process; within one, each turn follows
  the previous one after an exponential think time (open loop: it does not wait for the
  answer, as a replay of logged traffic does not).
- `shared_prompt_trace`: every request is one of `num_systems` long system prompts followed by
  a ShareGPT user prompt.

Each item carries `segments` (what its prompt is made of, by id, so the simulator can build
equal token runs for equal ids) and `messages` (the chat a live replay sends).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from lab.workload.traces.trace import Shape, TraceItem


@dataclass(frozen=True)
class Conversation:
    id: str
    users: tuple[str, ...]
    answers: tuple[str, ...]
    user_lens: tuple[int, ...]
    answer_lens: tuple[int, ...]

    @property
    def turns(self) -> int:
        return len(self.users)


def _exchanges(conv: dict) -> list[tuple[str, str]]:
    turns = conv.get("conversations") or []
    out = []
    for i in range(0, len(turns) - 1, 2):
        user, answer = turns[i], turns[i + 1]
        if user.get("from") != "human" or answer.get("from") != "gpt":
            break
        if not user.get("value", "").strip() or not answer.get("value", "").strip():
            break
        out.append((user["value"], answer["value"]))
    return out


def sharegpt_conversations(
    n: int,
    model: str = "smollm2-135m-instruct",
    data_dir: Path | None = None,
    min_turns: int = 2,
    max_turns: int = 8,
    max_total: int = 2048,
) -> list[Conversation]:
    """The first `n` test-split conversations with at least `min_turns` usable turns (parsed
    once per process and arguments)."""
    return list(_conversations(n, model, data_dir, min_turns, max_turns, max_total))


@lru_cache(maxsize=8)
def _conversations(
    n: int, model: str, data_dir: Path | None, min_turns: int, max_turns: int, max_total: int
) -> tuple[Conversation, ...]:
    from services.common.models import load_tokenizer
    from services.common.settings import CommonSettings
    from services.predictor.sharegpt import is_test, iter_conversations

    tokenizer = load_tokenizer(model, Path(data_dir or CommonSettings().data_dir))
    out: list[Conversation] = []
    for conv in iter_conversations():
        cid = str(conv.get("id"))
        exchanges = _exchanges(conv)[:max_turns]
        if len(exchanges) < min_turns or not is_test(cid):
            continue
        texts = [t for pair in exchanges for t in pair]
        lens = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        kept, history = 0, 0
        for k in range(len(exchanges)):
            user, answer = lens[2 * k], lens[2 * k + 1]
            if history + user + answer > max_total or user < 1 or answer < 1:
                break
            history += user + answer
            kept += 1
        if kept < min_turns:
            continue
        out.append(
            Conversation(
                cid,
                tuple(u for u, _ in exchanges[:kept]),
                tuple(a for _, a in exchanges[:kept]),
                tuple(lens[0 : 2 * kept : 2]),
                tuple(lens[1 : 2 * kept : 2]),
            )
        )
        if len(out) == n:
            break
    return tuple(out)


def conversation_turns(conv: Conversation) -> list[TraceItem]:
    """The turns of one conversation (arrival 0; `multiturn_trace` spreads them)."""
    items = []
    for k in range(conv.turns):
        segments, messages = [], []
        for j in range(k):
            segments += [
                (f"{conv.id}:u{j}", conv.user_lens[j]),
                (f"{conv.id}:a{j}", conv.answer_lens[j]),
            ]
            messages += [("user", conv.users[j]), ("assistant", conv.answers[j])]
        segments.append((f"{conv.id}:u{k}", conv.user_lens[k]))
        messages.append(("user", conv.users[k]))
        items.append(
            TraceItem(
                f"{conv.id}-t{k}",
                0.0,
                sum(n for _, n in segments),
                conv.answer_lens[k],
                None,
                f"{conv.id}:{k}",
                segments=tuple(segments),
                messages=tuple(messages),
            )
        )
    return items


def multiturn_trace(
    conversations: list[Conversation], rate: float, think_s: float = 5.0, seed: int = 0
) -> list[TraceItem]:
    """Every turn of every conversation, `rate` requests/s on average: conversations start as
    a Poisson process at rate / (mean turns), turns follow each other after exponential
    think times of mean `think_s`; sorted by arrival."""
    if rate <= 0 or think_s < 0:
        raise ValueError(f"need rate > 0 and think_s >= 0, got {rate}, {think_s}")
    rng = np.random.default_rng(seed)
    mean_turns = float(np.mean([c.turns for c in conversations]))
    starts = np.cumsum(rng.exponential(mean_turns / rate, size=len(conversations)))
    items = []
    for conv, start in zip(conversations, starts):
        t = float(start)
        for k, item in enumerate(conversation_turns(conv)):
            if k:
                t += float(rng.exponential(think_s)) if think_s else 0.0
            items.append(_at(item, t))
    return sorted(items, key=lambda i: (i.arrival_s, i.request_id))


def shared_prompt_trace(
    shapes: list[Shape],
    arrivals: list[float],
    system_len: int = 1024,
    num_systems: int = 1,
    seed: int = 0,
) -> list[TraceItem]:
    """Each shape's prompt behind one of `num_systems` system prompts of `system_len` tokens
    (chosen at random); the system prompt's text is a fixed filler for live replays."""
    rng = np.random.default_rng(seed)
    items = []
    for k, (shape, t) in enumerate(sorted(zip(shapes, arrivals), key=lambda p: p[1])):
        sys_id = f"system-{int(rng.integers(num_systems))}"
        filler = f"[{sys_id}] " + " ".join(["Follow the house style guide."] * (system_len // 6))
        messages = (("system", filler), ("user", shape.prompt or ""))
        items.append(
            TraceItem(
                f"req-{k}",
                float(t),
                system_len + shape.prompt_len,
                shape.output_len,
                None,
                shape.sample_id,
                segments=((sys_id, system_len), (f"p:{shape.sample_id or k}", shape.prompt_len)),
                messages=messages,
            )
        )
    return items


def _at(item: TraceItem, t: float) -> TraceItem:
    from dataclasses import replace

    return replace(item, arrival_s=t)
