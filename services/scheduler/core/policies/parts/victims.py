"""Eviction candidates in eviction order, produced lazily.

Most steps evict a handful of requests, so ordering every resident request up front would be
wasted work: candidates come from generators (a heap popped on demand, a walk of the level
queues) and can be handed back when a caller decides not to evict them after all.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from services.scheduler.core.request import Request

Ranked = tuple[int, "Request"]  # (rank of the chosen job it may be evicted for, request)
T = TypeVar("T", bound=tuple[object, ...])


class Victims:
    """An iterator over (rank, request) with peek and give-back."""

    def __init__(self, *sources: Iterable[Ranked]) -> None:
        self._src: Iterator[Ranked] = itertools.chain(*sources)
        self._back: list[Ranked] = []  # handed-back items; the last one comes next

    def peek(self) -> Ranked | None:
        if not self._back:
            item = next(self._src, None)
            if item is None:
                return None
            self._back.append(item)
        return self._back[-1]

    def pop(self) -> Ranked | None:
        item = self.peek()
        if item is not None:
            self._back.pop()
        return item

    def give_back(self, items: list[Ranked]) -> None:
        """Put popped items back in front, in the order they were popped."""
        self._back.extend(reversed(items))

    def __iter__(self) -> Iterator[Ranked]:
        while (item := self.pop()) is not None:
            yield item


def smallest_first(keyed: list[T]) -> Iterator[T]:
    """Yield the tuples of `keyed` in sorted order, sorting only as far as consumed."""
    heapq.heapify(keyed)
    while keyed:
        yield heapq.heappop(keyed)
