"""GRPCInferenceService (protos/grpc_predict_v2.proto) on the service host's grpc.aio server.

Tensors may come in `contents` (typed repeated fields) or `raw_input_contents`
(little-endian bytes; a BYTES element is a 4-byte length and its bytes);
the outputs (`probability`, unless the request names others: a multi-task
model's tasks by name) go back in `raw_output_contents`, as Triton answers
(every OIP client reads it).
"""
from __future__ import annotations

import math

import grpc
import numpy as np

from hybridrec.core.runtime import rpc
from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip
from services.inference.byte_elements import ByteElements
from services.inference.core import InferenceCore
from services.inference.inputs import DTYPES, BadInput, Tensor

SERVICE = "inference.GRPCInferenceService"
MAX_ELEMENTS = 1 << 26
_CONTENTS = {"BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
             "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents"}


_LITTLE_ENDIAN = {name: np.dtype(t).newbyteorder("<") for name, t in DTYPES.items()}
"""Each numeric datatype as raw contents hold it (built once: a request has several inputs)."""


def checked_shape(dims, what: str = "") -> tuple[int, ...]:
    """A tensor shape from either protocol, refused (BadInput) when negative or over MAX_ELEMENTS elements."""
    shape = tuple(int(d) for d in dims)
    if any(d < 0 for d in shape):
        raise BadInput(f"{what}shape {list(shape)} has a negative dimension")
    if any(d > MAX_ELEMENTS for d in shape):  # each on its own too: after a 0, the product stays 0
        raise BadInput(f"{what}shape {list(shape)[:8]} has a dimension past {MAX_ELEMENTS}")
    count = 1
    for d in shape:
        count *= d
        if count > MAX_ELEMENTS:
            raise BadInput(f"{what}shape {list(shape)} is too large")
    return shape


def split_bytes(raw: bytes, name: str) -> ByteElements:
    """BYTES elements of a raw tensor: each a 4-byte little-endian length, then that many bytes."""
    try:
        return ByteElements.from_prefixed(raw, name)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def tensors_of(request: oip.ModelInferRequest) -> list[Tensor]:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadInput(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input "
                       "or none")
    tensors = []
    for i, inp in enumerate(request.inputs):
        shape = checked_shape(inp.shape)
        count = math.prod(shape)
        if inp.datatype == "BYTES":
            data = split_bytes(raw[i], inp.name) if raw else ByteElements.of(inp.contents.bytes_contents)
            if len(data) != count:
                raise BadInput(f"input {inp.name!r}: shape {list(shape)} needs {count} elements, got {len(data)}")
        elif inp.datatype in DTYPES:
            dtype = _LITTLE_ENDIAN[inp.datatype]
            if raw:
                if len(raw[i]) != count * dtype.itemsize:
                    raise BadInput(f"input {inp.name!r}: shape {list(shape)} of {inp.datatype} needs "
                                   f"{count * dtype.itemsize} bytes, got {len(raw[i])}")
                data = np.frombuffer(raw[i], dtype)
            else:
                field = _CONTENTS.get(inp.datatype)
                if field is None:
                    raise BadInput(f"input {inp.name!r}: {inp.datatype} can only be sent in raw_input_contents")
                values = getattr(inp.contents, field)
                if len(values) != count:
                    raise BadInput(f"input {inp.name!r}: shape {list(shape)} needs {count} values in "
                                   f"contents.{field}, got {len(values)}")
                data = np.array(values, dtype=DTYPES[inp.datatype])
        else:
            raise BadInput(f"input {inp.name!r}: unknown datatype {inp.datatype!r}")
        tensors.append(Tensor(inp.name, inp.datatype, shape, data))
    return tensors


def _set_param(param: oip.InferParameter, value) -> None:
    """`value` into an InferParameter in place (a bool before an int: bool is an int in Python)."""
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


class GRPCInferenceServicer:
    def __init__(self, core: InferenceCore):
        self.core = core

    async def ServerLive(self, request, context):
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=self.core.ready)

    async def ModelReady(self, request, context):
        return oip.ModelReadyResponse(ready=self.core.model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(**self.core.server_metadata())

    async def ModelMetadata(self, request, context):
        meta = self.core.model_metadata(request.name, request.version)
        T = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                         inputs=[T(**t) for t in meta["inputs"]],
                                         outputs=[T(**t) for t in meta["outputs"]])

    async def ModelInfer(self, request, context):
        self.core.check_model(request.model_name, request.model_version)  # NOT_FOUND before any parsing
        answer = await self.core.infer(request.model_name, request.model_version, tensors_of(request),
                                       [o.name for o in request.outputs] if request.outputs else ())
        response = oip.ModelInferResponse(model_name=answer.model_name, model_version=answer.model_version,
                                          id=request.id)
        for name, value in answer.outputs.items():
            value = np.ascontiguousarray(value, np.float32)
            response.outputs.add(name=name, datatype="FP32", shape=value.shape)
            response.raw_output_contents.append(value.tobytes())
        for key, value in answer.parameters.items():
            _set_param(response.parameters[key], value)
        return response


def add_to_server(server: grpc.aio.Server, servicer: GRPCInferenceServicer) -> None:
    service = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(oip, method.input_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            rpc.guard(getattr(servicer, method.name), "inference", method.name),
            request_deserializer=request_cls.FromString,
            response_serializer=lambda msg: msg.SerializeToString(),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
