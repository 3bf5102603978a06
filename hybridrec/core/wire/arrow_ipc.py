"""Arrow IPC streams from bytes nobody vouches for (a stream message's payload): bounded before they are
decoded, fully validated after.

pyarrow decodes an IPC stream as its metadata says: a compressed buffer is decompressed into an allocation of
the size its first 8 bytes declare, so a few bytes can ask for gigabytes, and `read_all` checks a record
batch's buffers only as far as it must to build it (a string column's offsets are not checked against its
data, which a kernel reading them would then read out of bounds). `read_stream` therefore reads each
message's metadata first (the flatbuffer of Arrow's Message.fbs, walked with bounds checks: no generated code,
no dependency), adds up what its record batch or dictionary batch would allocate, and refuses the stream past
`max_bytes` before anything is decompressed; then it decodes and runs Arrow's full validation. Every failure
is `ArrowStreamError`, whatever pyarrow or the walker raised.
"""
from __future__ import annotations

import struct

ROW_BYTES = 64
"""A stream may declare at most `max_bytes // ROW_BYTES` rows: a boolean or null column of many rows is a few
bytes on the wire and far more once converted to the training data's arrays."""

# Message.fbs: Message { version: short; header_type: ubyte; header: MessageHeader; bodyLength: long; ... }
_MESSAGE_HEADER_TYPE, _MESSAGE_HEADER = 1, 2
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3
# RecordBatch { length: long; nodes: [FieldNode]; buffers: [Buffer]; compression: BodyCompression; ... }
_BATCH_LENGTH, _BATCH_BUFFERS, _BATCH_COMPRESSION = 0, 2, 3
# DictionaryBatch { id: long; data: RecordBatch; isDelta: bool }
_DICTIONARY_DATA = 1
_BUFFER_STRUCT = struct.Struct("<qq")  # Buffer { offset: long; length: long }


class ArrowStreamError(ValueError):
    """Bytes that are not an Arrow IPC stream this reader takes: malformed, inconsistent, or past the bound."""


def read_stream(data: bytes, max_bytes: int):
    """The pyarrow.Table of an IPC stream (a schema, then record batches), refused with ArrowStreamError when it
    is malformed, would allocate more than `max_bytes` to decode, declares more than `max_bytes // ROW_BYTES`
    rows, or fails Arrow's full validation."""
    import pyarrow as pa

    try:
        _check_bounds(pa.ipc.MessageReader.open_stream(pa.py_buffer(data)), max_bytes)
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
        table.validate(full=True)
    except ArrowStreamError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid, OSError, ...), all of them ours
        raise ArrowStreamError(f"not a valid Arrow IPC stream ({type(exc).__name__}: {exc})") from None
    return table


def _check_bounds(reader, max_bytes: int) -> None:
    """Walk every message's metadata: the bytes its buffers take once decompressed, and its rows, summed over
    the stream."""
    total_bytes = total_rows = 0
    while (message := _next(reader)) is not None:
        meta, body = memoryview(message.metadata), message.body
        kind, header = _header(meta)
        if kind == _SCHEMA:
            continue
        if kind == _DICTIONARY_BATCH:
            header = _field_table(meta, header, _DICTIONARY_DATA)
            if header is None:
                raise ArrowStreamError("a dictionary batch without its data")
        elif kind != _RECORD_BATCH:
            raise ArrowStreamError(f"a message of type {kind}: only a schema, dictionaries and record batches")
        rows, nbytes = _batch_size(meta, header, memoryview(body) if body is not None else memoryview(b""))
        total_rows += rows
        total_bytes += nbytes
        if total_bytes > max_bytes or total_rows > max_bytes // ROW_BYTES:
            raise ArrowStreamError(f"the stream decodes to {total_bytes:,} bytes and {total_rows:,} rows, past the "
                                   f"bound of {max_bytes:,} bytes and {max_bytes // ROW_BYTES:,} rows "
                                   f"(data.stream.max_message_bytes)")


def _next(reader):
    try:
        return reader.read_next_message()
    except StopIteration:
        return None


def _batch_size(meta: memoryview, batch: int, body: memoryview) -> tuple[int, int]:
    """(rows, bytes once decoded) of the RecordBatch table at `batch`: each buffer's declared uncompressed
    length when the body is compressed, its length in the body otherwise."""
    rows = _scalar(meta, batch, _BATCH_LENGTH, "<q", 0)
    if rows < 0:
        raise ArrowStreamError(f"a record batch of {rows} rows")
    compressed = _field(meta, batch, _BATCH_COMPRESSION) is not None
    total = 0
    for offset, length in _structs(meta, batch, _BATCH_BUFFERS, _BUFFER_STRUCT):
        if offset < 0 or length < 0 or offset + length > len(body):
            raise ArrowStreamError(f"a buffer at {offset} of {length} bytes outside a body of {len(body)}")
        if compressed and length >= 8:
            declared = struct.unpack_from("<q", body, offset)[0]
            total += length - 8 if declared == -1 else declared  # -1: stored uncompressed
            if declared < -1:
                raise ArrowStreamError(f"a compressed buffer declaring {declared} bytes")
        else:
            total += length
    return rows, total


# -- a flatbuffer, walked with every offset checked -------------------------------------------------------
def _u32(buf: memoryview, pos: int) -> int:
    if pos < 0 or pos + 4 > len(buf):
        raise ArrowStreamError("metadata offset out of range")
    return struct.unpack_from("<I", buf, pos)[0]


def _field(buf: memoryview, table: int, index: int) -> int | None:
    """The position of field `index` of the table at `table`, None when absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0] if 0 <= table <= len(buf) - 4 else -1
    if vtable < 0 or vtable + 4 > len(buf):
        raise ArrowStreamError("metadata vtable out of range")
    size = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * index
    if slot + 2 > size or vtable + slot + 2 > len(buf):
        return None
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else None


def _scalar(buf: memoryview, table: int, index: int, fmt: str, default: int) -> int:
    pos = _field(buf, table, index)
    if pos is None:
        return default
    if pos + struct.calcsize(fmt) > len(buf):
        raise ArrowStreamError("metadata field out of range")
    return struct.unpack_from(fmt, buf, pos)[0]


def _field_table(buf: memoryview, table: int, index: int) -> int | None:
    pos = _field(buf, table, index)
    return None if pos is None else pos + _u32(buf, pos)


def _header(buf: memoryview) -> tuple[int, int]:
    """(header type, position of the header table) of a Message flatbuffer."""
    root = _u32(buf, 0)
    kind = _scalar(buf, root, _MESSAGE_HEADER_TYPE, "<B", 0)
    header = _field_table(buf, root, _MESSAGE_HEADER)
    if header is None:
        raise ArrowStreamError("a message without a header")
    return kind, header


def _structs(buf: memoryview, table: int, index: int, layout: struct.Struct) -> list[tuple[int, ...]]:
    """The vector of structs at field `index`."""
    vector = _field_table(buf, table, index)
    if vector is None:
        return []
    count = _u32(buf, vector)
    start = vector + 4
    if start + count * layout.size > len(buf):
        raise ArrowStreamError("metadata vector out of range")
    return [layout.unpack_from(buf, start + i * layout.size) for i in range(count)]
