"""`SamplingParams`: how one request picks its tokens, the one type every service shares.

Pure (standard library only): the scheduling core carries it on each request. The proto
conversion lives in `services.common.sampling_pb`, so importing this module pulls in no
protobuf.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from services.common.guided import KINDS as GUIDE_KINDS


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_p 1 = disabled (0, the proto's unset value, means disabled
        too and is stored as 1.0); top_k 0 = disabled; seed None = unseeded. Penalties (OpenAI's
        presence/frequency on output tokens, vLLM's repetition on prompt and output; 1 or 0 = off),
        min_p (vLLM), logit_bias ((token id, bias) pairs) and bad_words (token sequences whose last
    token is banned wherever the output ends with the rest) change the logits before sampling,
        greedy or not. `top_logprobs` asks for that many most likely tokens (with their
        log-probabilities) per output position; `prompt_logprobs` (None = off) asks for the
        prompt tokens' log-probabilities with that many alternatives each. Out-of-range values raise ValueError naming the
        field. `guide_kind`/`guide_spec` constrain the answer to a structure."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0  # most likely alternatives reported per output token
    guide_kind: str = ""  # structured output (services/common/guided.py); "" = none
    guide_spec: str = ""
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output never completes
    prompt_logprobs: int | None = None  # prompt tokens' logprobs with this many alternatives

    def __post_init__(self) -> None:
        if self.guide_kind not in ("", *GUIDE_KINDS):
            raise ValueError(f"guide_kind must be one of {GUIDE_KINDS}, got {self.guide_kind!r}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty == 0:
            object.__setattr__(self, "repetition_penalty", 1.0)  # the proto's unset value
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        bias = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias))
        if any(t < 0 or not -100 <= b <= 100 for t, b in bias):
            raise ValueError("logit_bias needs token ids >= 0 and biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        words = tuple(tuple(int(t) for t in w) for w in self.bad_words)
        if any(not w or min(w) < 0 for w in words):
            raise ValueError("bad_words needs non-empty token sequences of ids >= 0")
        object.__setattr__(self, "bad_words", words)
        self._check_basic()

    def _check_basic(self) -> None:
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

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, min_p or a logit bias change this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_p
            or self.logit_bias
            or self.bad_words
        )

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-ready fields (the scheduler's Redis record)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Inverse of `to_dict`; absent keys (and None values) take their defaults."""
        fields = {k: v for k, v in data.items() if v is not None}
        if "logit_bias" in fields:  # JSON gives lists back
            fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields["logit_bias"])
        if "bad_words" in fields:
            fields["bad_words"] = tuple(tuple(w) for w in fields["bad_words"])
        return cls(**fields)
