"""Censored output lengths: answers cut by `max_tokens` only tell that they run at least that
far.

The predictor keeps two numbers per prompt: `length`, the expected length of the answers that
end on their own (EOS), and `p_capped`, the probability that the answer runs to the cap
instead. Everyone who needs one number for a request with a given `max_tokens` (the live
scheduler, the predictor's evaluation) asks `expected_length`: an answer that ends on its
own stops at `min(length, max_tokens)`, one that does not runs to `max_tokens`.
"""

from __future__ import annotations


def expected_length(length: float, p_capped: float, max_tokens: int) -> int:
    """Expected output tokens of a request capped at `max_tokens` (>= 1)."""
    p = min(1.0, max(0.0, p_capped))
    value = (1.0 - p) * min(length, max_tokens) + p * max_tokens
    return max(1, min(max_tokens, round(value)))


def merge_censored(
    length: float, count: int, capped: float, new_length: float, censored: bool
) -> tuple[float, int, float]:
    """A store point's (length, count, capped share) after one more observation.

    `length` is the mean over the uncensored observations while there is one; a point that
    has seen only censored answers keeps their largest lower bound."""
    eos = round(count * (1.0 - capped))  # observations that ended on their own
    new_capped = (capped * count + censored) / (count + 1)
    if censored:
        return (length if eos else max(length, new_length)), count + 1, new_capped
    mean = (length * eos + new_length) / (eos + 1) if eos else float(new_length)
    return mean, count + 1, new_capped
