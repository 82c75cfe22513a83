"""Small integer helpers shared by the core, the executor and the benchmarks."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """The smallest integer >= a / b, for b > 0 (blocks needed to hold `a` tokens of `b`)."""
    return -(-a // b)
