"""Structured outputs: a request's guide (JSON object, JSON schema, regex, choice, grammar)
compiled once with xgrammar, and per-request matchers that mask the logits.

A guide is `(kind, spec)`, carried in `SamplingParams.guide_kind` / `guide_spec`:

| kind | spec | from the API |
|---|---|---|
| `json` | "" | `response_format: {"type": "json_object"}` (any JSON object) |
| `json_schema` | the schema as JSON text | `response_format: {"type": "json_schema", ...}`, `guided_json` |
| `regex` | a regular expression | `guided_regex` |
| `choice` | a JSON list of strings | `guided_choice` |
| `grammar` | EBNF (xgrammar's GBNF dialect) | `guided_grammar` |

The gateway compiles every guide before admitting the request (an invalid one is a 400); the
executor compiles it again for its own vocabulary (cached per guide), gives each guided
request a matcher (rebuilt from the output tokens after a recompute), masks the rows of the
guided requests before sampling and advances their matchers with each sampled token. Once a
guide is complete only the end-of-sequence token is allowed, so the answer stops there.
JSON is generated compactly (no free whitespace: small models otherwise wander in it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


class GuideError(ValueError):
    """A guide that does not compile (the gateway answers 400)."""


def choice_grammar(spec: str) -> str:
    """EBNF accepting exactly one of the strings of a JSON list."""
    try:
        options = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GuideError(f"choice: not a JSON list: {exc}") from None
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise GuideError("choice: expected a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


class GuideCompiler:
    """xgrammar's compiler for one tokenizer and vocabulary size; compiled guides are cached."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.compiled = functools.lru_cache(maxsize=256)(self._compile)

    @classmethod
    def from_dir(cls, path: Path, vocab_size: int | None = None) -> GuideCompiler:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), vocab_size)

    def _compile(self, kind: str, spec: str) -> Any:
        c = self.compiler
        try:
            if kind == "json":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                return c.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec))
            if kind == "grammar":
                return c.compile_grammar(spec)
        except GuideError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            raise GuideError(f"{kind}: {str(exc).strip().splitlines()[0][:300]}") from None
        raise GuideError(f"unknown guide kind {kind!r} (one of {', '.join(KINDS)})")

    def check(self, kind: str, spec: str) -> None:
        """Raise GuideError unless the guide compiles."""
        self.compiled(kind, spec)

    def matcher(self, kind: str, spec: str, history: Sequence[int] = ()) -> Any:
        """A matcher at the start of the guide, advanced over `history` (output so far)."""
        m = self.xgr.GrammarMatcher(self.compiled(kind, spec))
        for token in history:
            if not m.accept_token(int(token)):
                break  # an output the guide rejects (e.g. made before the guide): stop there
        return m

    def mask(self, logits: Any, rows: Sequence[int], matchers: Sequence[Any]) -> None:
        """Mask, in place, the logits [S, V] of `rows` to the tokens their matchers allow."""
        xgr = self.xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.info.vocab_size)
        for row, m in zip(rows, matchers):
            m.fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=self.info.vocab_size, indices=list(rows)
        )
