"""Arrow IPC streams from untrusted bytes (hybridrec/core/wire/arrow_ipc.py): good streams (plain, lz4, zstd, dictionary
columns) decode as pyarrow decodes them; a decompression bomb, too many rows, corrupt offsets and random damage
are refused with ArrowStreamError and nothing else, before anything past the bound is allocated."""
from __future__ import annotations

import contextlib

import numpy as np
import pyarrow as pa
import pytest

from hybridrec.core.wire.arrow_ipc import ROW_BYTES, ArrowStreamError, read_stream

BOUND = 64 << 20


@contextlib.contextmanager
def _pool():
    """pyarrow's default memory pool for the block: a proxy that keeps its own peak (`max_memory`), whatever the
    rest of the process allocated before."""
    before = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(before)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(before)


def _stream(table: pa.Table, compression: str | None = None, chunk: int | None = 300) -> bytes:
    """An IPC stream of `table` in record batches of `chunk` rows (several batches, a dictionary message)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
        writer.write_table(table, max_chunksize=chunk)
    return sink.getvalue().to_pybytes()


def _table(n: int = 1_000) -> pa.Table:
    rng = np.random.default_rng(0)
    return pa.table({"x": pa.array(rng.integers(0, 1 << 40, n)), "d": pa.array(rng.standard_normal(n)),
                     "s": pa.array([f"token{i % 17}" for i in range(n)]),
                     "c": pa.array([f"c{i % 5}" for i in range(n)]).dictionary_encode(),
                     "l": pa.array([[i, i + 1] if i % 3 else None for i in range(n)], pa.list_(pa.int64()))})


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_good_streams_decode_as_pyarrow_decodes_them(compression):
    table = _table()
    data = _stream(table, compression)
    assert read_stream(data, BOUND).equals(pa.ipc.open_stream(pa.py_buffer(data)).read_all())
    assert read_stream(data, BOUND).num_rows == 1_000


def test_a_decompression_bomb_is_refused_before_it_is_decompressed():
    bomb = _stream(pa.table({"z": pa.array(np.zeros(20_000_000, np.int64))}), "lz4", chunk=None)  # 160 MB in under 1 MB
    assert len(bomb) < 1 << 20
    with _pool() as pool, pytest.raises(ArrowStreamError, match=r"decodes to 160,000,000 bytes .* past the bound "
                                                                r"of 67,108,864"):
        read_stream(bomb, BOUND)
    assert pool.max_memory() < 1 << 20, pool.max_memory()  # nothing near 160 MB was allocated
    with _pool() as pool:
        pa.ipc.open_stream(pa.py_buffer(bomb)).read_all()  # what pyarrow alone allocates
    assert pool.max_memory() >= 160_000_000


def test_rows_past_the_bound_are_refused_however_few_bytes_they_take():
    many = _stream(pa.table({"b": pa.array(np.zeros(BOUND // ROW_BYTES + 1, bool))}), chunk=None)
    with pytest.raises(ArrowStreamError, match="rows, past the bound"):
        read_stream(many, BOUND)


def test_string_offsets_past_their_data_are_refused():
    items = pa.array([f"i{i:04d}" for i in range(100)])
    data = bytearray(_stream(pa.table({"s": items}), chunk=None))
    offsets = np.arange(0, 501, 5, dtype=np.int32)
    at = bytes(data).index(offsets.tobytes())
    offsets[40:] += 1 << 20
    data[at:at + offsets.nbytes] = offsets.tobytes()
    with pytest.raises(ArrowStreamError, match="not a valid Arrow IPC stream"):
        read_stream(bytes(data), BOUND)


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_damaged_streams_raise_only_arrow_stream_error(compression):
    """Random bytes changed or the stream cut short: only the reader's own error escapes, and what it allocates stays
    under a small multiple of the bound."""
    good = _stream(_table(300), compression)
    rng = np.random.default_rng(1)
    with _pool() as pool:
        _damage(good, rng, 1_500)
    assert pool.max_memory() < 2 * BOUND, pool.max_memory()


def _damage(good: bytes, rng: np.random.Generator, times: int) -> None:
    refused = 0
    for _ in range(times):
        data = bytearray(good)
        for _ in range(rng.integers(1, 6)):
            data[rng.integers(len(data))] = rng.integers(256)
        if rng.random() < 0.2:
            data = data[:rng.integers(len(data))]
        try:
            table = read_stream(bytes(data), BOUND)
        except ArrowStreamError:
            refused += 1
            continue
        table.validate(full=True)
    assert refused > times // 10
