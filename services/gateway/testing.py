"""Run a real gateway (uvicorn on loopback) inside this process, for tests and benchmarks."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from services.common.redis_runner import free_port
from services.common.settings import GatewaySettings


@contextmanager
def running_gateway(settings: GatewaySettings, start_timeout_s: float = 120.0) -> Iterator[str]:
    """Serve `create_app(settings)` on 127.0.0.1 in a thread; yields the base URL."""
    import uvicorn

    from services.gateway.app import create_app

    port = settings.gateway_port or free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_config=None,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
