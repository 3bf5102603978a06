"""Generated protobuf messages of protos/*.proto, and the command that regenerates them.

`pb` is protos/hybridrec.proto (the training services' contract);
`hybridrec.core.wire.proto.grpc_predict_v2_pb2` is protos/grpc_predict_v2.proto (the Open
Inference Protocol the inference service speaks), imported only by what needs
it: it declares the package `inference`, as tritonclient's own generated code
does, and two files declaring the same messages cannot share one process's
protobuf descriptor pool.

Only message classes are generated: services are registered from the proto's
service descriptors by `hybridrec.core.runtime.rpc`, which gives every method whose request
type is `Frame` identity (raw-bytes) serializers.

Regenerate after editing the .proto:  python -m hybridrec.core.wire.proto
"""
from __future__ import annotations

from pathlib import Path

from hybridrec.core.wire.proto import hybridrec_pb2 as pb

PROTO_DIR = Path(__file__).resolve().parents[4] / "protos"
PROTOS = ("hybridrec.proto", "grpc_predict_v2.proto")

__all__ = ["pb", "regenerate"]


def regenerate() -> None:
    """Compile every .proto of PROTOS into this package with grpcio-tools."""
    from grpc_tools import protoc

    out = Path(__file__).resolve().parent
    for name in PROTOS:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", str(PROTO_DIR / name)]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
