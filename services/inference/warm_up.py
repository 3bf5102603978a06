"""Every compiled kernel a request can reach, compiled before the service turns ready.

numba compiles a kernel at its first call, once per kind of argument: an
array's dtype, and whether it is read-only (a view of a request's bytes) or
writable (a copy) are different kinds. A kernel first reached by a request
compiles on the event loop, and every request, health check and metrics
scrape waits for it: seconds on a clean install, where no numba cache holds
it yet (a followed version's merged table did that to a CI run for 19 s).
Which kernels a request reaches depends on its form (`rows`, `ids`, by
feature name), each input's datatype and whether it came as raw bytes or as
typed contents.

So before the service says it is ready, `warm_up` sends the loaded model one
request of every form it takes, with every ID datatype, raw and as contents,
through the service's own decoding and forward, with rows of zeros for the
embeddings (not through the batcher's counters or the metrics). What it
misses is caught: after it, a kernel that still compiles is logged as
`kernel_compiled_while_serving`, with its name and how long it took
(`hybridrec.core.runtime.kernel_cache.watch_compiles`, which every service starts as it
turns SERVING).
"""
from __future__ import annotations

import asyncio
import dataclasses
import struct
from typing import Iterator

import numpy as np

from hybridrec.core.runtime import log
from hybridrec.core.config import FeatureKind
from hybridrec.core.layouts.criteo_format import NUM_DENSE, NUM_SPARSE
from hybridrec.core.wire.ids import GROUP_SHIFT
from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip
from services.inference.inputs import LENGTHS_SUFFIX, InputDecoder

_ID_CONTENTS = {"INT64": "int64_contents", "INT32": "int_contents", "UINT64": "uint64_contents"}
_ID_DTYPES = {"INT64": np.int64, "INT32": np.int32, "UINT64": np.uint64}
_ROW = b"\t".join([b"1"] * NUM_DENSE + [b"68fd1e64"] * NUM_SPARSE)
"""A Criteo line without its label."""


def _add(request: oip.ModelInferRequest, name: str, datatype: str, values, raw: bool) -> None:
    """One input: `values` a numpy array, or a list of bytes for BYTES."""
    if datatype == "BYTES":
        t = request.inputs.add(name=name, datatype=datatype, shape=[len(values)])
        if raw:
            request.raw_input_contents.append(b"".join(struct.pack("<I", len(v)) + v for v in values))
        else:
            t.contents.bytes_contents.extend(values)
        return
    t = request.inputs.add(name=name, datatype=datatype, shape=list(values.shape))
    if raw:
        request.raw_input_contents.append(np.ascontiguousarray(values).tobytes())
    else:
        field = "fp32_contents" if datatype == "FP32" else _ID_CONTENTS[datatype]
        getattr(t.contents, field).extend(values.reshape(-1).tolist())


def probe_requests(decoder: InputDecoder, model_name: str) -> Iterator[oip.ModelInferRequest]:
    """Requests of one sample in every form `decoder`'s model takes, each raw and as typed contents: `rows`
    (when the model reads Criteo columns), `ids` (UINT64 and INT64) with `dense`, and every feature by name as
    each ID datatype (a list feature with its lengths)."""
    dense = np.zeros((1, decoder.num_dense), np.float32)
    ids = np.array([[(int(g) << GROUP_SHIFT) | 1 for g in decoder.groups]], np.uint64)
    for raw in (True, False):
        if decoder.columns is not None:
            request = oip.ModelInferRequest(model_name=model_name)
            _add(request, "rows", "BYTES", [_ROW], raw)
            yield request
        for datatype in ("UINT64", "INT64"):
            request = oip.ModelInferRequest(model_name=model_name)
            _add(request, "ids", datatype, ids.view(_ID_DTYPES[datatype]), raw)
            _add(request, "dense", "FP32", dense, raw)
            yield request
        for datatype in ("INT64", "INT32", "UINT64", "BYTES"):
            request = oip.ModelInferRequest(model_name=model_name)
            _add(request, "dense", "FP32", dense, raw)
            for f in decoder.features:
                values = [b"1"] if datatype == "BYTES" else np.ones(1, _ID_DTYPES[datatype])
                _add(request, f.name, datatype, values, raw)
                if f.kind == FeatureKind.LIST:
                    _add(request, f.name + LENGTHS_SUFFIX, "INT64", np.ones(1, np.int64), raw)
            yield request


class _ZeroTable:
    """Rows of zeros: the probes need the forward's kernels, not the embeddings (the table's own kernel is
    compiled when a table opens, `hybridrec.core.model.table_lookup.warm_up`), and a remote table's channels belong to
    the
    service's event loop, not to the warm-up's."""

    async def lookup(self, ids_by_width: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        return {dim: np.zeros((ids.shape[0], dim), np.float32) for dim, ids in ids_by_width.items()}


async def warm_up(model, batcher, model_name: str, max_request_rows: int) -> int:
    """Run every probe request through the service's decoder and `batcher`'s forward path for `model` (no
    counters, no metrics), in a worker thread, so the event loop keeps answering health checks while kernels
    compile; returns how many ran. A probe that fails is logged (`warm_up_probe_failed`: a bug in the probes)
    and the service starts all the same."""
    decoder = InputDecoder(model.manifest, max_request_rows)
    model = dataclasses.replace(model, table=_ZeroTable())
    return await asyncio.get_running_loop().run_in_executor(None, _run_probes, decoder, batcher, model, model_name)


def _run_probes(decoder: InputDecoder, batcher, model, model_name: str) -> int:
    from services.inference.grpc_api import tensors_of

    async def probes() -> int:
        count = 0
        for request in probe_requests(decoder, model_name):
            try:
                await batcher.run(model, [decoder.decode(tensors_of(request))])
            except Exception as exc:  # noqa: BLE001 - a probe's fault must not keep the model from serving
                log.get().error("warm_up_probe_failed", inputs=[(t.name, t.datatype) for t in request.inputs],
                                error=f"{type(exc).__name__}: {exc}")
            else:
                count += 1
        return count

    return asyncio.run(probes())
