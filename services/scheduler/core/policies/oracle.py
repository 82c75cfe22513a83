"""`oracle`: `alise` holding the true output lengths as its prior (benchmarks and simulation
only; forecasts are then ignored).

The true length is read from `Request.true_len` when set; otherwise, for a request that ignores
EOS, `max_tokens` is its exact length (the simulator replays traces that way); otherwise
`max_tokens` is the best upper bound available.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.core.policies.alise import AlisePolicy
from services.scheduler.core.policies.base import register_variant

if TYPE_CHECKING:
    from services.scheduler.core.request import Request


def true_length(req: Request) -> int:
    if req.true_len is not None:
        return max(1, req.true_len)
    return req.max_tokens


register_variant("oracle", AlisePolicy, prior=true_length)
