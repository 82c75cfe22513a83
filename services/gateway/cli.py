"""`alise gateway serve`: run the OpenAI-compatible HTTP gateway (uvicorn)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

    import uvicorn

    from services.common.settings import GatewaySettings


def _serve(args: argparse.Namespace) -> int:

    from services.common.logs import setup_logging
    from services.common.settings import GatewaySettings
    from services.gateway.app import create_app

    overrides = {
        k: v for k, v in (("gateway_host", args.host), ("gateway_port", args.port)) if v is not None
    }
    settings = GatewaySettings(**overrides)
    setup_logging("gateway", settings.log_level, settings.log_format)
    app = create_app(settings)
    DrainingServer = _draining_server_class(settings.drain_s)
    DrainingServer(server_config(app, settings)).run()
    return 0


def server_config(app: Any, settings: GatewaySettings) -> uvicorn.Config:
    """The HTTP server's settings for the gateway app."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_s) + 2,
        timeout_keep_alive=settings.keep_alive_s,
        backlog=4096,
        limit_concurrency=settings.max_connections or None,
    )


def _draining_server_class(drain_s: float) -> type[uvicorn.Server]:
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On SIGINT/SIGTERM: stop accepting, let open streams run for drain_s (ALISE_DRAIN_S), then end the
        rest with a clear error event (aborted upstream) before uvicorn closes connections."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state = getattr(self.config.app.state, "gateway", None)
            if state is not None and not self.should_exit:
                asyncio.get_event_loop().call_later(drain_s, state.shutting_down.set)
            super().handle_exit(sig, frame)

    return DrainingServer


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    group.set_defaults(_parser=group)
    inner = group.add_subparsers(dest="gateway_command", metavar="COMMAND")
    serve = inner.add_parser(
        "serve",
        help="serve /v1/completions, /v1/chat/completions, "
        "/health, /metrics and the playground at /",
    )
    serve.add_argument("--host", default=None, help="bind address (ALISE_GATEWAY_HOST)")
    serve.add_argument("--port", type=int, default=None, help="port (ALISE_GATEWAY_PORT)")
    serve.set_defaults(func=_serve)
