"""Generate the gRPC/protobuf Python stubs from proto/*.proto into services/common/pb.

grpc_tools writes flat imports (`import common_pb2`); we rewrite them to package-relative
imports so the stubs import from the installed package without sys.path edits.
Run: `python -m services.common.protogen [--out DIR]`.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PB_DIR = Path(__file__).resolve().parent / "pb"
_FLAT_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into out_dir; returns the written files."""
    import grpc_tools  # type: ignore[import-untyped]  # ships no stubs
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ]
        rc = protoc.main(args + [str(p) for p in proto_files()])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        written = []
        for src in sorted(Path(tmp).iterdir()):
            text = _FLAT_IMPORT.sub(r"from . import \1 as \2", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC stubs (do not edit; run `make proto`)."""\n')
    return written + [init]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PB_DIR)
    out = parser.parse_args().out
    if out == PB_DIR and out.exists():
        shutil.rmtree(out)
    for path in generate(out):
        print(path)


if __name__ == "__main__":
    main()
