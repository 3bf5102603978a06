"""Coverage-guided fuzz targets, one per decoder of bytes from outside (run by tests/fuzz/run.py under atheris).

Each target takes the fuzzer's bytes as a sender would deliver them and lets only the decoder's own error type
escape: anything else (an IndexError from numpy, a RecursionError, a MemoryError, a crash in a kernel) is a
finding. Each has a seed corpus of well-formed inputs in tests/fuzz/corpus/<target>/ (`seeds`), written by
`python -m tests.fuzz.run --write-seeds`.

The bound on memory is the fuzzer's: libFuzzer's `-rss_limit_mb` (tests/fuzz/run.py `RSS_LIMIT_MB`) over
inputs of at most `-max_len` bytes (`MAX_LEN`): a decoder that allocates more than that for such an input
fails the run.
"""
from __future__ import annotations

import json
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

MAX_LEN = 1 << 20
"""The largest input the fuzzer makes (libFuzzer's -max_len)."""


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    """Decode one input; raises only `expected`."""
    expected: tuple[type[BaseException], ...]
    seeds: Callable[[], list[bytes]]


def _values():
    from hybridrec.core.wire.compress import ValueCodec

    return ValueCodec(fp16=True, kappa=1024.0)


# -- the frame codec and every frame kind ----------------------------------------------------------------------
def _codec(data: bytes) -> None:
    from hybridrec.core.wire import codec

    frame = codec.decode(data, lz4={"a", "b", "p0", "pos"}, lz4_bytes=64 * len(data) + (1 << 16))
    for array in frame.tensors.values():
        array.sum()  # every byte of every view within the frame


def _codec_seeds() -> list[bytes]:
    from hybridrec.core.wire import codec

    a = np.arange(100, dtype=np.uint16)
    return [codec.encode({"a": a, "b": np.ones((3, 4), np.float32)}, {"k": 1}, compress={"a"}),
            codec.encode(meta={"m": 7}), codec.encode({"x": np.zeros(0, np.uint64)})]


FRAME_KINDS = ("sparse", "embeddings", "gradients", "lookup", "update", "rows", "shard_rows", "shard_pull", "applied",
               "consumed", "received", "nn_batch", "ref", "checked")


def _frames(data: bytes) -> None:
    """The first byte picks the decoder, the rest is its frame (a config of two features of widths 4 and 8)."""
    from hybridrec.core.wire import frames
    from hybridrec.core.layouts.slot_layouts import CheckedEmbeddings

    if not data:
        return
    kind, buf = FRAME_KINDS[data[0] % len(FRAME_KINDS)], data[1:]
    values = _values()
    decoders = {
        "sparse": lambda: frames.SparseBatch.decode(buf, 2, ids_per_sample=8),
        "embeddings": lambda: frames.Embeddings.decode(buf, values, [4, 8], 5, ids_per_sample=8),
        "gradients": lambda: frames.Gradients.peek(buf) and frames.Gradients.decode(buf, values,
                                                                                      lambda ref: {4: 3, 8: 2}),
        "lookup": lambda: frames.PSLookup.decode(buf, {4, 8}, max_ids=1000),
        "update": lambda: frames.PSUpdate.decode(buf, values, {4, 8}, max_ids=1000),
        "rows": lambda: frames.PSRows.decode(buf, values, {4: 3, 8: 2}),
        "shard_rows": lambda: frames.ShardRows.decode(buf, {4: 8, 8: 16}),
        "shard_pull": lambda: frames.ShardPull.decode(buf),
        "applied": lambda: frames.Applied.decode(buf),
        "consumed": lambda: frames.Consumed.decode(buf),
        "received": lambda: frames.Received.decode(buf),
        "nn_batch": lambda: frames.decode_nn_batch(buf, 3, 1, 2),
        "ref": lambda: frames.BatchRef.decode(buf),
        "checked": lambda: CheckedEmbeddings.decode(buf, [1]),
    }
    decoders[kind]()


def _frames_seeds() -> list[bytes]:
    from hybridrec.core.wire import frames
    from hybridrec.core.wire.jagged import KeyedBags

    values = _values()
    ids = np.arange(1, 9, dtype=np.uint64)
    bags = KeyedBags(np.array([0, 1, 0, 1, 2, 0, 1, 0], np.uint16), np.array([[1, 1, 2, 1, 0], [1, 1, 1, 0, 0]],
                                                                              np.uint16))
    emb = frames.Embeddings(bags, np.array([3, 2], np.int32),
                            {4: np.ones((3, 4), np.float32), 8: np.ones((2, 8), np.float32)})
    sparse = frames.SparseBatch.from_columns(np.stack([ids[:5], ids[3:8]], axis=1), np.ones((5, 2), bool),
                                             phase="train")
    encoded = {
        "sparse": sparse.encode(), "embeddings": emb.encode(values),
        "gradients": frames.Gradients(9, {4: np.ones((3, 4), np.float32), 8: np.ones((2, 8), np.float32)})
        .encode(values),
        "lookup": frames.PSLookup({4: ids}, train=True).encode(),
        "update": frames.PSUpdate({4: ids}, {4: np.ones((8, 4), np.float32)}, 5).encode(values),
        "rows": frames.PSRows({4: np.ones((3, 4), np.float32), 8: np.ones((2, 8), np.float32)}).encode(values),
        "shard_rows": frames.ShardRows(0, 1, 2, {4: (ids[:2], np.ones((2, 8), np.float32))}, update_id=3).encode(),
        "shard_pull": frames.ShardPull(0, "primary").encode(), "applied": frames.Applied(3, ((0, 1),)).encode(),
        "consumed": frames.Consumed("train", 4).encode(), "received": frames.Received(loader=1).encode(),
        "nn_batch": frames.DenseBatch(7, np.ones((4, 3), np.float32), np.zeros(4, np.float32), "train", seq=1,
                                      loader=1).encode(),
        "ref": frames.BatchRef(12).encode(),
        "checked": b"",
    }
    return [bytes([FRAME_KINDS.index(kind)]) + frame for kind, frame in encoded.items()]


# -- Arrow event messages, TSV lines -----------------------------------------------------------------------------
_READER = None


def _arrow(data: bytes) -> None:
    """A stream message in Arrow format through the data loader's reader (bounds, validation, the columns)."""
    global _READER
    from services.dataloader.stream import Message, MessageReader

    if _READER is None:
        from hybridrec.core.config import from_dict

        _READER = MessageReader(from_dict(_ARROW_CONFIG), "fuzz")
    _READER.read(Message(1, data, 0, 0.0, "arrow"))


_ARROW_CONFIG = {"data": {"train": ["x"], "format": "parquet", "labels": ["y"], "dense_columns": ["d"],
                          "non_finite": "skip"},
                 "num_dense": 1, "features": [{"name": "u", "group": 1}, {"name": "t", "group": 2, "kind": "list"}]}


def _arrow_seeds() -> list[bytes]:
    import pyarrow as pa

    from hybridrec.core.layouts.event_stream import encode_arrow

    table = pa.table({"y": pa.array([0, 1, 1]), "d": pa.array([0.5, np.nan, 2.0]),
                      "u": pa.array([1, 2 ** 63 + 5, None], pa.uint64()),
                      "t": pa.array([["a", "b"], [], None])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(table)
    return [encode_arrow(table), sink.getvalue().to_pybytes(),
            encode_arrow(table.set_column(2, "u", pa.array(["x", "y", None]).dictionary_encode()))]


def _tsv(data: bytes) -> None:
    from services.dataloader.tsv import parse_lines

    parse_lines(data, where="fuzz", bad_lines="skip", non_finite="skip")  # nothing may escape
    parse_lines(data, where="fuzz", bad_lines="error", non_finite="error")  # CriteoFormatError at most


def _tsv_seeds() -> list[bytes]:
    line = b"\t".join([b"1", *[b"3"] * 13, *[b"68fd1e64"] * 26])
    return [line + b"\n" + line.replace(b"\t3\t", b"\t\t", 1), b"0\t-1" + line[3:] + b"\r\n"]


# -- the inference service's inputs ------------------------------------------------------------------------------
_DECODER = None


def _decoder():
    global _DECODER
    if _DECODER is None:
        from hybridrec.core.layouts.bundle import BundleManifest
        from hybridrec.core.config import FeatureConfig, ModelConfig
        from services.inference.inputs import InputDecoder

        features = [FeatureConfig(name=f"C{i + 1}", group=i, dim=4) for i in range(26)]
        manifest = BundleManifest(features=features, num_dense=13, model=ModelConfig(path="hybridrec.models:DNN"),
                                  num_shards=1, dense_columns=[f"I{i + 1}" for i in range(13)])
        _DECODER = InputDecoder(manifest, 64)
    return _DECODER


def _oip_rest(data: bytes) -> None:
    """An infer request's REST body: the first byte says whether a binary header length comes with it."""
    from services.inference.rest import parse_request

    if not data:
        return
    header = str(int.from_bytes(data[1:3], "little")) if data[0] & 1 else None
    _, tensors, _ = parse_request(data[3:] if data[0] & 1 else data[1:], header)
    _decoder().decode(tensors)


_ROW = b"\t".join([b"1"] * 13 + [b"ab"] * 26)
"""A Criteo line without its label, as `rows` takes it."""
_IDS = [(f << 56) | 7 for f in range(26)]
"""One sample's IDs, feature group in the top 8 bits (hybridrec.core.wire.ids)."""


def _oip_rest_seeds() -> list[bytes]:
    body = {"inputs": [*({"name": f"C{f + 1}", "datatype": "BYTES", "shape": [1], "data": ["ab"]} for f in range(26)),
                       {"name": "dense", "datatype": "FP32", "shape": [1, 13], "data": [0.5] * 13}]}
    ids = {"inputs": [{"name": "ids", "datatype": "UINT64", "shape": [1, 26], "data": _IDS},
                      {"name": "dense", "datatype": "FP32", "shape": [1, 13], "data": [0.5] * 13}]}
    head = json.dumps({"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": 4 + len(_ROW)}}]}).encode()
    return [b"\0" + json.dumps(body).encode(), b"\0" + json.dumps(ids).encode(),
            b"\1" + len(head).to_bytes(2, "little") + head + struct.pack("<I", len(_ROW)) + _ROW]


def _oip_grpc(data: bytes) -> None:
    from google.protobuf.message import DecodeError

    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip
    from services.inference.grpc_api import tensors_of
    from services.inference.inputs import BadInput

    try:
        request = oip.ModelInferRequest.FromString(data)
    except (DecodeError, RecursionError) as exc:  # as the gRPC server's deserializer refuses it
        raise BadInput(f"not a ModelInferRequest: {exc}") from None
    _decoder().decode(tensors_of(request))


def _oip_grpc_seeds() -> list[bytes]:
    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    rows = oip.ModelInferRequest(model_name="m", inputs=[oip.ModelInferRequest.InferInputTensor(
        name="rows", datatype="BYTES", shape=[1])])
    rows.raw_input_contents.append(struct.pack("<I", len(_ROW)) + _ROW)
    ids = oip.ModelInferRequest(model_name="m", inputs=[
        oip.ModelInferRequest.InferInputTensor(name="ids", datatype="UINT64", shape=[1, 26],
                                               contents=oip.InferTensorContents(uint64_contents=_IDS)),
        oip.ModelInferRequest.InferInputTensor(name="dense", datatype="FP32", shape=[1, 13],
                                               contents=oip.InferTensorContents(fp32_contents=[0.5] * 13))])
    return [rows.SerializeToString(), ids.SerializeToString()]


# -- manifests ---------------------------------------------------------------------------------------------------
_DIR = None


def _manifests(data: bytes) -> None:
    """A manifest file's bytes, read as a bundle's, a job checkpoint's or prepared data's (the first byte)."""
    global _DIR
    from hybridrec.core.layouts import bundle, checkpoints
    from services.dataloader import prepared

    if not data:
        return
    if _DIR is None:
        _DIR = Path(tempfile.mkdtemp(prefix="fuzz-manifests-"))
    kind = data[0] % 3
    name = (bundle.MANIFEST, checkpoints.MANIFEST, prepared.MANIFEST)[kind]
    (_DIR / name).write_bytes(data[1:])
    (bundle.read_manifest, checkpoints.read_manifest, prepared.read_manifest)[kind](_DIR)


def _manifests_seeds() -> list[bytes]:
    from hybridrec.core.layouts import checkpoints
    from hybridrec.core.layouts.bundle import BundleManifest
    from hybridrec.core.config import FeatureConfig, ModelConfig

    manifest = BundleManifest(features=[FeatureConfig(name="C1", group=0, dim=4)], num_dense=13,
                              model=ModelConfig(path="hybridrec.models:DNN"), num_shards=1, created=0.0)
    job = checkpoints.JobManifest(step=4, seq=4, position=[0, 0, 10, 2],
                                  files={"dense.pt": {"bytes": 10, "sha256": "ab" * 32}})
    prep = {"format": "hybridrec-prepared", "format_version": 1, "hybridrec_version": "0", "fingerprint": "x",
            "schema": {}, "sources": [], "shards": []}
    from dataclasses import asdict

    return [b"\0" + manifest.model_dump_json().encode(), b"\1" + json.dumps(asdict(job)).encode(),
            b"\2" + json.dumps(prep).encode()]


def _errors() -> dict[str, tuple[type[BaseException], ...]]:
    from hybridrec.core.wire.arrow_ipc import ArrowStreamError
    from hybridrec.core.layouts.bundle import BundleError
    from hybridrec.core.wire.codec import FrameError
    from services.dataloader.stream import BadMessage
    from services.dataloader.tsv import CriteoFormatError
    from services.inference.inputs import BadInput

    return {"codec": (FrameError,), "frames": (FrameError, ValueError), "arrow": (BadMessage, ArrowStreamError),
            "tsv": (CriteoFormatError,), "oip_rest": (BadInput,), "oip_grpc": (BadInput,),
            "manifests": (BundleError, ValueError)}


RUNS = {"codec": (_codec, _codec_seeds), "frames": (_frames, _frames_seeds), "arrow": (_arrow, _arrow_seeds),
        "tsv": (_tsv, _tsv_seeds), "oip_rest": (_oip_rest, _oip_rest_seeds), "oip_grpc": (_oip_grpc, _oip_grpc_seeds),
        "manifests": (_manifests, _manifests_seeds)}


def target(name: str) -> Target:
    run, seeds = RUNS[name]
    return Target(name, run, _errors()[name], seeds)
