"""`alise serve`: one command that starts the stack on this machine.

Only services that exist are started; the list grows as services land (see README).
"""
from __future__ import annotations

import argparse
import signal
import threading


def _serve(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.common.redis_runner import EmbeddedRedis
    from services.common.settings import LauncherSettings

    settings = LauncherSettings()
    setup_logging("launcher", settings.log_level, settings.log_format)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if settings.redis_url:
        print(f"using Redis at {settings.redis_url}")
        redis_server = None
    else:
        redis_server = EmbeddedRedis(settings.data_dir / "redis").start()
        print(f"embedded Redis running at {redis_server.url}")
    print("The gateway, predictor, scheduler and executor services are not implemented yet; "
          "only Redis is running. Ctrl-C stops it.", flush=True)
    try:
        stop.wait()
    finally:
        if redis_server:
            redis_server.stop()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="start the whole stack on this machine")
    serve.set_defaults(func=_serve)
