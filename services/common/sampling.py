"""`SamplingParams`: how one request picks its tokens, the one type every service shares.

Pure (standard library only): the scheduling core carries it on each request. The proto
conversion lives in `services.common.sampling_pb`, so importing this module pulls in no
protobuf.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_p 1 = disabled (0, the proto's unset value, means disabled
    too and is stored as 1.0); top_k 0 = disabled; seed None = unseeded. Out-of-range values
    raise ValueError naming the field."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # `not >=` also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p == 0:
            object.__setattr__(self, "top_p", 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-ready fields (the scheduler's Redis record)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Inverse of `to_dict`; absent keys (and None values) take their defaults."""
        return cls(**{k: v for k, v in data.items() if v is not None})
