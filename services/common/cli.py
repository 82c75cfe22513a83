"""`alise proto` (regenerate stubs) and `alise config` (print every setting and its default)."""
from __future__ import annotations

import argparse


def _proto(args: argparse.Namespace) -> int:
    from services.common import protogen

    for path in protogen.generate(protogen.PB_DIR):
        print(path)
    return 0


def _config(args: argparse.Namespace) -> int:
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


def register(subparsers: argparse._SubParsersAction) -> None:
    proto = subparsers.add_parser("proto", help="regenerate the gRPC stubs from proto/")
    proto.set_defaults(func=_proto)
    config = subparsers.add_parser("config", help="list every ALISE_* setting and its default")
    config.add_argument("--markdown", action="store_true", help="as a Markdown table")
    config.set_defaults(func=_config)
