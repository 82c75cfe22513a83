"""What every route reads: the gateway's settings, metrics, tokenizer, upstream clients and
prompt builder, stored Responses (`request.app.state.gateway`, built by app.py at start-up)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.common.settings import GatewaySettings
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.prompts import PromptBuilder
    from services.gateway.responses_api.store import ResponseStore
    from services.gateway.upstream import Upstream


@dataclass
class GatewayState:
    settings: GatewaySettings
    metrics: GatewayMetrics
    tokenizer: PreTrainedTokenizerBase
    upstream: Upstream
    prompts: PromptBuilder
    model_id: str
    config_max_len: int
    started: int
    responses: ResponseStore  # stored Responses (/v1/responses)
    # Set when the server is stopping and the drain period is over: open streams end with an
    # error event (and their requests are aborted upstream) instead of being cut.
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)

    def max_model_len(self) -> int:
        """The context a request may use: the model's length, and no more than the largest
        executor KV pool holds (both as the scheduler reports them, once it has)."""
        return self.upstream.context_limit(self.config_max_len)
