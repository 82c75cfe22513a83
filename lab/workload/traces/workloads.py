"""Request shapes (token counts, text) for the workloads the benchmarks use.

- `sharegpt_shapes`: the ShareGPT train or test split (`traces/sharegpt.py`), each
  prompt with its reference answer's true length.
- `mixed_long_prompt_shapes`: AccelGen's mixed-prompt scenario: short chat requests plus a
  configurable share of long prompts (4K-32K tokens, log-uniform), whose answers borrow the
  chat answers' length distribution.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from lab.workload.traces.trace import Shape


def sample_shapes(
    pool: list[Shape], n: int | None, seed: int = 0, replace: bool = False
) -> list[Shape]:
    """n shapes from the pool: a seeded shuffle (with replacement when n > len(pool) or
    `replace`); n = None keeps the whole pool in its order."""
    if not pool:
        raise ValueError("empty pool of request shapes")
    if n is None:
        return list(pool)
    if n < 1:
        raise ValueError(f"need at least one request, got n={n}")
    rng = np.random.default_rng(seed)
    if replace or n > len(pool):
        idx = rng.integers(0, len(pool), size=n)
    else:
        idx = rng.permutation(len(pool))[:n]
    return [pool[i] for i in idx]


def sharegpt_pool(
    split: str = "test", model: str = "smollm2-135m-instruct", data_dir=None
) -> list[Shape]:
    """The split as shapes (parsed once per process)."""
    return list(_sharegpt_pool(split, model, data_dir))


@lru_cache(maxsize=4)
def _sharegpt_pool(split: str, model: str, data_dir) -> tuple[Shape, ...]:
    from services.predictor.sharegpt import load_split

    return tuple(
        Shape(s.prompt_len, s.output_len, s.prompt, s.id)
        for s in load_split(split, model, data_dir)
    )


def sharegpt_shapes(
    n: int | None = None,
    split: str = "test",
    seed: int = 0,
    model: str = "smollm2-135m-instruct",
    data_dir=None,
) -> list[Shape]:
    return sample_shapes(sharegpt_pool(split, model, data_dir), n, seed)


def mixed_long_prompt_shapes(
    short_pool: list[Shape],
    n: int,
    long_share: float = 0.35,
    long_min: int = 4096,
    long_max: int = 32768,
    max_output: int = 2048,
    seed: int = 0,
) -> list[Shape]:
    """n requests: a `long_share` of them get a prompt of long_min..long_max tokens."""
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    if not 1 <= long_min <= long_max:
        raise ValueError(f"need 1 <= long_min <= long_max, got {long_min}, {long_max}")
    rng = np.random.default_rng(seed)
    base = sample_shapes(short_pool, n, seed, replace=True)
    is_long = rng.random(n) < long_share
    long_lens = np.exp(rng.uniform(np.log(long_min), np.log(long_max), size=n)).astype(int)
    shapes = []
    for i, s in enumerate(base):
        out = min(s.output_len, max_output)
        if is_long[i]:
            shapes.append(Shape(int(long_lens[i]), out, None, f"long-{i}"))
        else:
            shapes.append(Shape(s.prompt_len, out, s.prompt, s.sample_id))
    return shapes
