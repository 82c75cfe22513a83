"""Log-probabilities in OpenAI's shapes (chat `logprobs`/`top_logprobs`, completions
`logprobs`).

The executor reports each sampled token's log-probability under the model's raw distribution
and, for requests that ask, its `top_logprobs` most likely tokens (`services/executor/
sampler.py`). Here they become `TokenLogprob`s (the token's text as the tokenizer decodes it
alone, its UTF-8 bytes) and then the chat shape (`{"content": [{token, logprob, bytes,
top_logprobs}]}`) or the legacy completions shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`). A log-probability of -inf is reported as -9999.0, as OpenAI
does, because JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FLOOR = -9999.0


@dataclass(frozen=True)
class Alternative:
    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None: the prompt's first token (nothing before it), as OpenAI
    bytes: list[int]
    top: list[Alternative] | None = field(default_factory=list)


class LogprobDecoder:
    """Token id -> its text alone (cached: the same ids recur in every top list). With
    `skip_special_tokens` a sampled special token (the EOS that ends the answer) gets no entry,
    as it gets no text: the entries' tokens join to the answer's text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skipped = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        got = self._cache.get(token_id)
        if got is None:
            got = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = got
        return got

    def alternative(self, token_id: int, logprob: float) -> Alternative:
        text = self.text(token_id)
        return Alternative(text, max(float(logprob), FLOOR), list(text.encode("utf-8")))

    def entry(self, token_id: int, logprob: float, top: Iterable) -> TokenLogprob | None:
        """One output position: the sampled token and its alternatives (TopLogprob messages);
        None for a skipped special token."""
        if token_id in self.skipped:
            return None
        chosen = self.alternative(token_id, logprob)
        alts = [self.alternative(t.token_id, t.logprob) for t in top]
        return TokenLogprob(chosen.token, chosen.logprob, chosen.bytes, alts)

    def prompt_entries(self, ids: list[int], given: list) -> list[TokenLogprob]:
        """Completions `echo` with `logprobs`: one entry per prompt token (special ones
        included, as they are part of the prompt). The first has none (null, as OpenAI);
        `given` holds positions 1.. (PromptLogprob messages) or is empty after a scheduler
        failover, when every entry's logprob is null."""
        out = []
        for i, token_id in enumerate(ids):
            pl = given[i - 1] if i and len(given) == len(ids) - 1 else None
            if pl is None:
                text = self.text(token_id)
                out.append(TokenLogprob(text, None, list(text.encode("utf-8")), None))
                continue
            chosen = self.alternative(token_id, pl.logprob)
            alts = [self.alternative(t.token_id, t.logprob) for t in pl.top]
            out.append(TokenLogprob(chosen.token, chosen.logprob, chosen.bytes, alts))
        return out


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def one(a: Alternative | TokenLogprob) -> dict:
        return {"token": a.token, "logprob": a.logprob, "bytes": a.bytes}

    return {
        "content": [{**one(e), "top_logprobs": [one(a) for a in e.top or ()]} for e in entries],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict:
    """The legacy shape; `offset` = characters of text before the first entry's token."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.top is None else {a.token: a.logprob for a in e.top} for e in entries
        ],
        "text_offset": offsets,
    }
