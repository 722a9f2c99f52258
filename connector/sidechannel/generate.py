"""Regenerate the checked-in protobuf/gRPC modules from sidechannel.proto.

Run: ``python -m turbowire.connector.sidechannel.generate`` (needs grpcio-tools, a test extra).
The proto is compiled under its package path so the generated modules import each other as
``turbowire.connector.sidechannel.sidechannel_pb2``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE_PATH = Path("turbowire/connector/sidechannel")


def main() -> int:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / PACKAGE_PATH).mkdir(parents=True)
        shutil.copy(HERE / "sidechannel.proto", root / PACKAGE_PATH / "sidechannel.proto")
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{root}",
                f"--python_out={root}",
                f"--pyi_out={root}",
                f"--grpc_python_out={root}",
                str(PACKAGE_PATH / "sidechannel.proto"),
            ]
        )
        if rc != 0:
            return rc
        for name in ("sidechannel_pb2.py", "sidechannel_pb2.pyi", "sidechannel_pb2_grpc.py"):
            shutil.copy(root / PACKAGE_PATH / name, HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
