"""`alise proto` (regenerate stubs), `alise config` (every setting, or every policy knob, with
its default), `alise health` and `alise model copy` (fill a model volume once)."""

from __future__ import annotations

import argparse


def _proto(args: argparse.Namespace) -> int:
    from services.common import protogen

    for path in protogen.generate(protogen.PB_DIR):
        print(path)
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.policies:
        return _policy_knobs()
    from services.common.settings import settings_table

    rows = settings_table()
    if args.markdown:
        print("| variable | default | meaning |\n|---|---|---|")
        for name, default, doc in rows:
            print(f"| `{name}` | `{default}` | {doc} |")
    else:
        for name, default, doc in rows:
            print(f"{name}={default}  # {doc}")
    return 0


def _policy_knobs() -> int:
    """Every registered policy's knobs and defaults, as the JSON `ALISE_POLICY_CONFIG` takes."""
    import json

    from services.scheduler.core.policies import available_policies, policy_knobs

    for name in available_policies():
        print(f"{name} {json.dumps(policy_knobs(name))}")
    return 0


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when the target is healthy: used by docker-compose health checks."""
    if args.kind == "grpc":
        from services.common.grpc_client import check_health_sync

        ok = check_health_sync(args.target, args.service, timeout=args.timeout)
    else:
        import httpx

        try:
            ok = httpx.get(args.target, timeout=args.timeout).status_code == 200
        except httpx.HTTPError:
            ok = False
    print("healthy" if ok else "unhealthy")
    return 0 if ok else 1


def _model_copy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.common.models import copy_model

    copied = copy_model(Path(args.source), Path(args.target))
    print(f"copied {args.source} to {args.target}" if copied else f"{args.target}: already there")
    return 0


def _register_model(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = subparsers.add_parser("model", help="model directories")
    commands = model.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    copy = commands.add_parser(
        "copy",
        help="copy a Hugging Face model directory (or cache entry) into TARGET once, "
        "atomically and under a lock (the Kubernetes model volume's init container)",
    )
    copy.add_argument("source")
    copy.add_argument("target", help="a directory to create; its parent must be writable")
    copy.set_defaults(func=_model_copy)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    health = subparsers.add_parser("health", help="check a service's health (exit 0 = healthy)")
    health.add_argument("kind", choices=["grpc", "http"])
    health.add_argument("target", help="host:port (grpc) or URL (http)")
    health.add_argument("--timeout", type=float, default=2.0)
    health.add_argument(
        "--service",
        default="",
        help="gRPC service name (default: the whole server; `alise.v1.Scheduler` is SERVING "
        "only on the leading scheduler)",
    )
    health.set_defaults(func=_health)
    proto = subparsers.add_parser("proto", help="regenerate the gRPC stubs from proto/")
    proto.set_defaults(func=_proto)
    config = subparsers.add_parser("config", help="list every ALISE_* setting and its default")
    config.add_argument("--markdown", action="store_true", help="as a Markdown table")
    config.add_argument(
        "--policies",
        action="store_true",
        help="list each scheduling policy's knobs and defaults instead",
    )
    config.set_defaults(func=_config)
    _register_model(subparsers)
