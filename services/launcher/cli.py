"""`alise serve`: the whole stack on this machine with one command.

Starts the embedded Redis (unless ALISE_REDIS_URL), the predictor, N executors, the
scheduler (and, with --schedulers 2 or more, standbys that take over when it fails) and the
gateway, waits for every health check, prints the URL and a curl example,
restarts crashed services with backoff, and on Ctrl-C stops everything in reverse order.
Every flag has an ALISE_* variable (flag wins).
"""

from __future__ import annotations

import argparse
import signal
import threading
from datetime import datetime
from pathlib import Path
from typing import Any


def _curl_example(url: str, model: str) -> str:
    body = (
        f'{{"model": "{model}", "stream": true, "max_tokens": 64, '
        '"messages": [{"role": "user", "content": "Tell me a fun fact about owls."}]}'
    )
    return f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def _overrides(args: argparse.Namespace, policy: str) -> dict[str, str]:
    """ALISE_* variables the flags set for every service (flag wins)."""
    out = {"ALISE_POLICY": args.policy or policy}
    if args.load_format:
        out["ALISE_LOAD_FORMAT"] = args.load_format
    if args.model:
        out["ALISE_MODEL"] = args.model
    return out


def _supervisor(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The stack `alise serve` runs, and what it prints about it."""
    from services.common.internal_auth import TOKEN_ENV, internal_token
    from services.common.logs import setup_logging
    from services.common.redis_runner import free_port, generate_password
    from services.common.settings import (
        ExecutorSettings,
        GatewaySettings,
        LauncherSettings,
        SchedulerSettings,
    )
    from services.launcher import cpu_plan
    from services.launcher.supervisor import Supervisor, base_env
    from services.launcher.topology import LocalPorts, RedisPlan, local_topology

    settings = LauncherSettings()
    gateway = GatewaySettings()
    setup_logging("launcher", settings.log_level, settings.log_format)
    run_dir = Path(
        settings.run_dir or settings.data_dir / "runs" / datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    info = {
        "executors": args.executors or settings.num_executors,
        "schedulers": args.schedulers or settings.num_schedulers,
        "port": args.port if args.port is not None else gateway.gateway_port,
        "host": args.host or gateway.gateway_host,
        "run_dir": run_dir,
        "settings": settings,
    }
    overrides = _overrides(args, SchedulerSettings().policy)
    # the internal plane's shared secret: the given one, else one of its own per start
    overrides[TOKEN_ENV] = internal_token() or generate_password()
    # the embedded Redis: loopback, a password of its own per start, supervised as a child
    redis = (
        None
        if settings.redis_url
        else RedisPlan(str(settings.data_dir / "redis"), free_port(), generate_password())
    )
    specs = local_topology(
        info["executors"],
        settings.redis_url,
        gateway_host=info["host"],
        gateway_port=info["port"],
        num_schedulers=info["schedulers"],
        redis=redis,
        ports=LocalPorts(settings.internal_port_base),
    )
    info["policy"] = overrides["ALISE_POLICY"]
    env = base_env(overrides)
    cpu = cpu_plan.plan(info["executors"], ExecutorSettings().num_threads, settings.control_nice)
    info["cpu"] = cpu.describe(env)
    return Supervisor(cpu_plan.apply(specs, cpu, env), run_dir, env), info


def _serve(args: argparse.Namespace) -> int:
    from services.common.models import served_model_id

    supervisor, info = _supervisor(args)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(
            f"starting ALISE ({info['executors']} executor(s), {info['schedulers']} "
            f"scheduler(s), policy {info['policy']}); logs in {info['run_dir']}\n{info['cpu']}",
            flush=True,
        )
        supervisor.start_all(info["settings"].health_timeout_s)
        host = info["host"]
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{info['port']}"
        print(
            f"\nALISE is ready at {url}  (playground: {url}/ , metrics: {url}/metrics)\n"
            f"Try:\n  {_curl_example(url, served_model_id(args.model or info['settings'].model))}\n",
            flush=True,
        )
        while not stop.wait(0.5):
            for name in supervisor.poll():
                print(f"restarted {name} (crashed)", flush=True)
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", flush=True)
        return 1
    finally:
        print(
            "stopping: draining the gateway, then scheduler, executors, predictor, redis...",
            flush=True,
        )
        supervisor.stop_all()
        print("stopped.", flush=True)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser(
        "serve", help="start the whole stack (Redis, predictor, executors, scheduler, gateway)"
    )
    serve.add_argument(
        "--executors",
        type=int,
        default=0,
        help="number of executors (ALISE_NUM_EXECUTORS, default 1)",
    )
    serve.add_argument(
        "--schedulers",
        type=int,
        default=0,
        help="schedulers: one leads, the others stand by (ALISE_NUM_SCHEDULERS, default 1)",
    )
    serve.add_argument(
        "--port", type=int, default=None, help="gateway port (ALISE_GATEWAY_PORT, default 8000)"
    )
    serve.add_argument(
        "--host", default="", help="gateway bind address (ALISE_GATEWAY_HOST, default 127.0.0.1)"
    )
    serve.add_argument("--policy", default="", help="scheduling policy (ALISE_POLICY)")
    serve.add_argument(
        "--model",
        default="",
        help="model: a Hugging Face directory, a .gguf file, a shape preset or the bundled "
        "model (ALISE_MODEL; families: docs/models.md)",
    )
    serve.add_argument(
        "--load-format",
        default="",
        choices=["", "auto", "dummy"],
        help="dummy: random weights of the model's shapes (ALISE_LOAD_FORMAT, default auto)",
    )
    serve.set_defaults(func=_serve)
    _register_redis(subparsers)


def _redis_serve(args: argparse.Namespace) -> int:
    from services.common.redis_runner import exec_server
    from services.launcher.topology import REDIS_PASSWORD_ENV

    exec_server(Path(args.dir), args.host, args.port, REDIS_PASSWORD_ENV)
    return 1  # not reached: the process is now redis-server


def _register_redis(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser(
        "redis", help="the embedded Redis that `alise serve` supervises"
    ).add_subparsers(dest="redis_command", metavar="COMMAND")
    serve = group.add_parser(
        "serve",
        help="exec the bundled redis-server (append-only file in --dir; the password, if any, "
        "from ALISE_EMBEDDED_REDIS_PASSWORD)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--dir", required=True, help="data directory (append-only file)")
    serve.set_defaults(func=_redis_serve)
