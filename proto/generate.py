"""Regenerate the committed Python code for every .proto under proto/.

Run from anywhere: ``python proto/generate.py``. The output mirrors the proto paths
(proto/federation/api/v1/x.proto -> federation/api/v1/x_pb2.py) with .pyi types.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out: Path) -> int:
    """Run protoc with the Python, gRPC and mypy plugins, writing under ``out``."""
    sources = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    # The mypy plugins are console scripts installed beside this interpreter.
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    return protoc.main(args)


if __name__ == "__main__":
    sys.exit(generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))
