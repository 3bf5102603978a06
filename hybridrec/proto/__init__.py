"""Generated protobuf messages of protos/hybridrec.proto, and the command that regenerates them.

Only message classes are generated: services are registered from the proto's
service descriptors by `hybridrec.rpc`, which gives every method whose request
type is `Frame` identity (raw-bytes) serializers.

Regenerate after editing the .proto:  python -m hybridrec.proto
"""
from __future__ import annotations

from pathlib import Path

from hybridrec.proto import hybridrec_pb2 as pb

PROTO_DIR = Path(__file__).resolve().parents[2] / "protos"

__all__ = ["pb", "regenerate"]


def regenerate() -> None:
    """Compile protos/hybridrec.proto into this package with grpcio-tools."""
    from grpc_tools import protoc

    out = Path(__file__).resolve().parent
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", str(PROTO_DIR / "hybridrec.proto")]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
