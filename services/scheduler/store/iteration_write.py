"""`IterationWrite`: everything one loop iteration changed, as the store commits it, and the
Redis value formats it shares with the store (store.py) and the Lua commit (store_script.py).
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

TOKEN = struct.Struct("<ifd")  # token id, logprob, unix time
QUEUES = ("waiting", "running", "swapped")
FieldValue = str | int | float


@dataclass
class IterationWrite:
    """Everything one loop iteration changed; applied atomically by the writer."""

    fields: dict[str, dict[str, FieldValue]] = field(default_factory=lambda: defaultdict(dict))
    tokens: dict[str, tuple[int, bytearray]] = field(default_factory=dict)
    queue: dict[str, tuple[str | None, float]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    held_add: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    held_remove: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    executors: dict[str, dict[str, FieldValue]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    def set(self, rid: str, **values: FieldValue) -> None:
        self.fields[rid].update(values)

    def add_token(self, rid: str, index: int, token_id: int, logprob: float, t: float) -> None:
        """Append output token `index`; consecutive indices of one request must be added.
        The commit sets the record's n_out with the tokens (store_script.py)."""
        got = self.tokens.get(rid)
        if got is None:
            self.tokens[rid] = (index, bytearray(TOKEN.pack(token_id, logprob, t)))
            return
        start, buf = got
        if start + len(buf) // TOKEN.size != index:
            raise ValueError(f"token {index} of {rid} is not contiguous")
        buf += TOKEN.pack(token_id, logprob, t)

    def move(self, rid: str, queue: str | None, score: float) -> None:
        """Put `rid` in one queue (None = in none: finished)."""
        self.queue[rid] = (queue, score)

    def finish(self, rid: str) -> None:
        self.queue[rid] = (None, 0.0)
        self.finished.append(rid)

    @property
    def empty(self) -> bool:
        return not (
            self.fields
            or self.tokens
            or self.queue
            or self.held_add
            or self.held_remove
            or self.executors
            or self.counters
            or self.callbacks
        )
