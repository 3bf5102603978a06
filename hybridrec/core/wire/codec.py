"""Tensor frames: the data-plane wire format of every hybridrec service (docs/architecture.md#data-plane-frames).

A frame is one bytes object:

    fixed header   magic "HRF1", version, flags, tensor count, table length, meta length
    tensor table   per tensor: name, dtype code, codec, shape, offset, stored and raw byte counts
    meta           a small JSON object (batch_ref, step, flags...) — JSON, never pickle
    buffers        each tensor's bytes, starting at a 64-byte-aligned offset

Decoding returns numpy arrays that *view* the received bytes (`np.frombuffer`,
no copy); only lz4-compressed buffers are materialised. Encoding makes exactly
one copy of each tensor, into the outgoing bytes object gRPC sends.

Every length and shape in an incoming frame is checked against the bytes that
actually arrived, so a malformed or hostile frame raises `FrameError` (which
services turn into INVALID_ARGUMENT) and never an exception from deep inside
numpy, an over-allocation or a crash. The whole tensor table is read and
checked before any tensor is materialised: names unique, buffers inside the
frame and not overlapping, and lz4 accepted only on the tensors the frame's
kind compresses (`decode`'s `lz4`), their raw bytes together within the
decoder's budget (`lz4_bytes`: what its RPC can need). Only lz4 allocates
(a raw tensor is a view), so a small frame cannot make its receiver
allocate much: on 3b8ae06 one frame of 1 MB, sixteen entries sharing one
lz4 block of 256 MiB of zeros, raised a PS's peak memory by 4.3 GiB.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Mapping

import lz4.block
import numpy as np

MAGIC = b"HRF1"
VERSION = 1
ALIGN = 64
MAX_TENSORS = 256
MAX_NDIM = 8
MAX_NAME_BYTES = 64
MAX_META_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1 << 30

# dtype code on the wire -> numpy dtype. Codes are stable; never renumber.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),
    2: np.dtype("<f2"),
    3: np.dtype("<f8"),
    4: np.dtype("<u8"),
    5: np.dtype("<i8"),
    6: np.dtype("<i4"),
    7: np.dtype("<u4"),
    8: np.dtype("<u2"),
    9: np.dtype("<i2"),
    10: np.dtype("u1"),
    11: np.dtype("i1"),
    12: np.dtype("?"),
}
_CODE_OF = {dt: code for code, dt in DTYPES.items()}

CODEC_RAW = 0
CODEC_LZ4 = 1

_FIXED = struct.Struct("<4sBBHII")  # magic, version, flags, n_tensors, table_len, meta_len
_ENTRY = struct.Struct("<BBBBQQQ")  # name_len, dtype, codec, ndim, offset, stored_nbytes, raw_nbytes


class FrameError(ValueError):
    """A frame that does not decode: truncated, lying about its shapes, unknown dtype, oversized."""


@dataclass
class Frame:
    """Decoded frame: named arrays (views of the received bytes) and a small JSON meta dict."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, dtype: np.dtype | str | None = None, ndim: int | None = None) -> np.ndarray:
        """The tensor `name`, checked for dtype and rank; a mismatch is a FrameError (→ INVALID_ARGUMENT)."""
        if name not in self.tensors:
            raise FrameError(f"frame has no tensor {name!r} (has {sorted(self.tensors)})")
        arr = self.tensors[name]
        if dtype is not None and arr.dtype != np.dtype(dtype):
            raise FrameError(f"tensor {name!r} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
        if ndim is not None and arr.ndim != ndim:
            raise FrameError(f"tensor {name!r} has {arr.ndim} dimensions, expected {ndim}")
        return arr

    def meta_int(self, key: str, *, default: int | None = None) -> int:
        value = self.meta.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise FrameError(f"frame meta {key!r} must be an integer, got {value!r}")
        return value


def align(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN: where a buffer after `n` bytes starts (codec frames, the dense
    batch frame, the receiver's slot layouts)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode(
    tensors: Mapping[str, np.ndarray] | None = None,
    meta: Mapping[str, Any] | None = None,
    *,
    compress: frozenset[str] | set[str] = frozenset(),
) -> bytes:
    """Encode arrays (C-contiguous or not) and meta into one frame; names in `compress` are lz4-compressed."""
    head, parts, _ = _layout(tensors, meta, compress)
    return b"".join(_chunks(head, parts))


def encode_into(
    allocate: Callable[[int], memoryview],
    tensors: Mapping[str, np.ndarray] | None = None,
    meta: Mapping[str, Any] | None = None,
    *,
    compress: frozenset[str] | set[str] = frozenset(),
) -> int:
    """`encode`, written into the buffer `allocate(nbytes)` returns (e.g. a shared-memory slot) rather than
    into a new bytes object; returns the frame's length. Each tensor is copied once, as by `encode`."""
    head, parts, nbytes = _layout(tensors, meta, compress)
    out = memoryview(allocate(nbytes)).cast("B")
    pos = 0
    for chunk in _chunks(head, parts):
        piece = memoryview(chunk)
        out[pos:pos + piece.nbytes] = piece
        pos += piece.nbytes
    return nbytes


def _layout(tensors: Mapping[str, np.ndarray] | None, meta: Mapping[str, Any] | None,
            compress: frozenset[str] | set[str]) -> tuple[bytes, list[tuple[int, Any, int]], int]:
    """A frame's header (fixed part, tensor table, meta), each tensor's (offset, data, stored bytes), and
    the frame's length."""
    tensors = tensors or {}
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a frame holds at most {MAX_TENSORS} tensors, got {len(tensors)}")
    meta_bytes = json.dumps(dict(meta or {}), separators=(",", ":")).encode() if meta else b""
    if len(meta_bytes) > MAX_META_BYTES:
        raise ValueError(f"frame meta is {len(meta_bytes)} bytes, limit {MAX_META_BYTES}")

    payloads: list[tuple[bytes, np.ndarray | bytes, int, int, np.ndarray]] = []
    table_len = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        code = _CODE_OF.get(arr.dtype.newbyteorder("<"))
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} is not supported on the wire")
        if arr.ndim > MAX_NDIM:
            raise ValueError(f"tensor {name!r}: {arr.ndim} dimensions, limit {MAX_NDIM}")
        name_b = name.encode()
        if len(name_b) > MAX_NAME_BYTES:
            raise ValueError(f"tensor name {name!r} is longer than {MAX_NAME_BYTES} bytes")
        arr = np.ascontiguousarray(arr, dtype=DTYPES[code])
        codec = CODEC_LZ4 if name in compress and arr.nbytes > 0 else CODEC_RAW
        data: np.ndarray | bytes = lz4.block.compress(arr, store_size=False) if codec == CODEC_LZ4 else arr
        payloads.append((name_b, data, code, codec, arr))
        table_len += _ENTRY.size + len(name_b) + 8 * arr.ndim

    header_len = _FIXED.size + table_len + len(meta_bytes)
    offset = align(header_len)
    parts: list[Any] = []
    table = bytearray()
    for name_b, data, code, codec, arr in payloads:
        stored = len(data) if isinstance(data, bytes) else arr.nbytes
        table += _ENTRY.pack(len(name_b), code, codec, arr.ndim, offset, stored, arr.nbytes)
        table += name_b + struct.pack(f"<{arr.ndim}Q", *arr.shape)
        parts.append((offset, data, stored))
        offset = align(offset + stored)
    head = _FIXED.pack(MAGIC, VERSION, 0, len(payloads), len(table), len(meta_bytes)) + bytes(table) + meta_bytes

    end = parts[-1][0] + parts[-1][2] if parts else len(head)
    return head, parts, max(end, len(head))


def _chunks(head: bytes, parts: list[tuple[int, Any, int]]) -> list[Any]:
    """The frame as consecutive pieces: the header, padding, each tensor's bytes."""
    chunks: list[Any] = [head]
    pos = len(head)
    for off, data, stored in parts:
        if off > pos:
            chunks.append(b"\0" * (off - pos))
        chunks.append(data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else data)
        pos = off + stored
    return chunks


@dataclass(frozen=True)
class _Entry:
    """One tensor of a frame's table, checked but not yet materialised."""

    name: str
    dtype: np.dtype
    codec: int
    shape: tuple[int, ...]
    count: int
    offset: int
    stored: int
    raw: int


def decode(buf: bytes | bytearray | memoryview, *, max_bytes: int = MAX_FRAME_BYTES,
           lz4: Container[str] = frozenset(), lz4_bytes: int = 0) -> Frame:
    """Decode a frame without copying raw buffers; raise FrameError on anything malformed. `lz4`: the tensors
    this frame's kind may compress (any other compressed tensor is refused), `lz4_bytes`: the most raw bytes
    they may decompress to together (the decoder's budget, from what its RPC can need). Every check is made
    on the whole table before a tensor is decompressed."""
    mv = memoryview(buf).cast("B")
    size = mv.nbytes
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
    if size < _FIXED.size:
        raise FrameError(f"frame of {size} bytes is shorter than its fixed header ({_FIXED.size} bytes)")
    magic, version, _flags, n_tensors, table_len, meta_len = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}; not a hybridrec frame")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this build reads {VERSION})")
    if n_tensors > MAX_TENSORS or meta_len > MAX_META_BYTES:
        raise FrameError(f"frame declares {n_tensors} tensors and {meta_len} meta bytes; limits are "
                         f"{MAX_TENSORS} and {MAX_META_BYTES}")
    header_len = _FIXED.size + table_len + meta_len
    if header_len > size:
        raise FrameError(f"frame header claims {header_len} bytes but the frame has {size}")

    entries = _table(mv, n_tensors, table_len, header_len, max_bytes)
    _check_buffers(entries, lz4, lz4_bytes)
    frame = Frame()
    table_end = _FIXED.size + table_len
    if meta_len:
        try:
            meta = json.loads(bytes(mv[table_end:table_end + meta_len]))
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, an integer of thousands of digits,
            raise FrameError(f"frame meta is not valid JSON: {str(exc)[:200]}") from None  # nesting too deep
        if not isinstance(meta, dict):
            raise FrameError("frame meta must be a JSON object")
        frame.meta = meta
    for entry in entries:
        frame.tensors[entry.name] = _tensor(mv, entry)
    return frame


def _table(mv: memoryview, n_tensors: int, table_len: int, header_len: int, max_bytes: int) -> list[_Entry]:
    """The tensor table's entries, each checked on its own: dtype, shape against bytes, buffer in the frame."""
    entries = []
    pos = _FIXED.size
    table_end = _FIXED.size + table_len
    for _ in range(n_tensors):
        if pos + _ENTRY.size > table_end:
            raise FrameError("tensor table is truncated")
        name_len, code, codec, ndim, offset, stored, raw = _ENTRY.unpack_from(mv, pos)
        pos += _ENTRY.size
        if ndim > MAX_NDIM:
            raise FrameError(f"tensor has {ndim} dimensions, limit {MAX_NDIM}")
        if pos + name_len + 8 * ndim > table_end:
            raise FrameError("tensor table is truncated")
        try:
            name = bytes(mv[pos:pos + name_len]).decode()
        except UnicodeDecodeError as exc:
            raise FrameError("tensor name is not UTF-8") from exc
        pos += name_len
        shape = struct.unpack_from(f"<{ndim}Q", mv, pos)
        pos += 8 * ndim
        entries.append(_entry(mv.nbytes, name, code, codec, shape, offset, stored, raw, header_len, max_bytes))
    if pos != table_end:
        raise FrameError(f"tensor table length {table_len} does not match its {n_tensors} entries")
    return entries


def _entry(size: int, name: str, code: int, codec: int, shape: tuple[int, ...], offset: int, stored: int,
           raw: int, header_len: int, max_bytes: int) -> _Entry:
    dtype = DTYPES.get(code)
    if dtype is None:
        raise FrameError(f"tensor {name!r} has unknown dtype code {code}")
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize != raw:
        raise FrameError(f"tensor {name!r}: shape {shape} of {dtype} needs {count * dtype.itemsize} bytes, "
                         f"frame says {raw}")
    if raw > max_bytes:
        raise FrameError(f"tensor {name!r} of {raw} bytes exceeds the limit of {max_bytes}")
    if offset % ALIGN or offset < header_len or offset + stored > size:
        raise FrameError(f"tensor {name!r}: buffer [{offset}, {offset + stored}) is misaligned or outside "
                         f"the {size}-byte frame")
    if codec not in (CODEC_RAW, CODEC_LZ4):
        raise FrameError(f"tensor {name!r} has unknown codec {codec}")
    if codec == CODEC_RAW and stored != raw:
        raise FrameError(f"tensor {name!r}: stored {stored} bytes but raw size is {raw}")
    return _Entry(name, dtype, codec, shape, count, offset, stored, raw)


def _check_buffers(entries: list[_Entry], lz4: Container[str], lz4_bytes: int) -> None:
    """The table as a whole: names unique, no two buffers overlapping (one compressed block named sixteen
    times would decompress sixteen times), lz4 only where the frame's kind has it, within its budget."""
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise FrameError(f"tensor names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    spans = sorted((entry.offset, entry.offset + entry.stored, entry.name) for entry in entries if entry.stored)
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise FrameError(f"tensors {name!r} and {other!r} share bytes of the frame")
    compressed = [entry for entry in entries if entry.codec == CODEC_LZ4]
    for entry in compressed:
        if entry.name not in lz4:
            raise FrameError(f"tensor {entry.name!r} is lz4-compressed, which this frame's kind does not do")
    total = sum(entry.raw for entry in compressed)
    if total > lz4_bytes:
        raise FrameError(f"the frame's compressed tensors decompress to {total} bytes, past this request's "
                         f"budget of {lz4_bytes}")


def _tensor(mv: memoryview, entry: _Entry) -> np.ndarray:
    name, dtype, count = entry.name, entry.dtype, entry.count
    if entry.codec == CODEC_RAW:
        return np.frombuffer(mv, dtype=dtype, count=count, offset=entry.offset).reshape(entry.shape)
    try:
        data = lz4.block.decompress(mv[entry.offset:entry.offset + entry.stored], uncompressed_size=entry.raw)
    except lz4.block.LZ4BlockError as exc:
        raise FrameError(f"tensor {name!r}: lz4 data is corrupt: {exc}") from exc
    if len(data) != entry.raw:
        raise FrameError(f"tensor {name!r}: lz4 data decompressed to {len(data)} bytes, expected {entry.raw}")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(entry.shape)
