"""Rows of a bundle's sharded tables for a batch of IDs, in one compiled pass (`EmbeddingTable.lookup`).

The inference service looks up every request's IDs in the bundle's tables: per
shard, sorted keys and their rows, memory-mapped. In numpy that is a dozen
array operations per shard and width (routing, searchsorted, masks, a
gather), about 30 microseconds at batch 1 whatever the batch: a tenth of a
request's budget. Here each ID is routed (`hybridrec.core.wire.sharding`'s splitmix64,
mod the shard count), binary-searched in its shard's keys and its row copied,
in one loop per shard. Imported (with numba) when a bundle's table is opened
(`EmbeddingTable`), not with `hybridrec.core.layouts.bundle`. The splitmix64 constants are
`hybridrec.core.wire.sharding`'s, written here again on purpose: numba's cache is keyed
on this file alone, and a constant read from another module would not
invalidate it.
"""
from __future__ import annotations

import numpy as np

from hybridrec.core.runtime.kernel_cache import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


_NO_SCALES = np.zeros(0, np.uint16)


def lookup_into(keys: list[np.ndarray], rows: list[np.ndarray], ids: np.ndarray, out: np.ndarray,
                scales: list[np.ndarray] | None = None) -> None:
    """`out[i]` = the row of `ids[i]` in shard splitmix64(id) % len(keys) (sorted `keys[s]`, `rows[s]`), or
    zeros for an ID without one; with `scales` (int8 rows of a quantized bundle), row * its scale."""
    shards = np.uint64(len(keys))
    for shard in range(len(keys)):
        # float16 scales as their bits: numba has no float16 type
        _find(keys[shard], rows[shard], _NO_SCALES if scales is None else scales[shard].view(np.uint16), ids, out,
              np.uint64(shard), shards)


@njit(inline="always")
def _half(bits):
    """The float32 value of float16 bits (a scale: finite)."""
    e = (np.int64(bits) >> 10) & 31
    m = np.int64(bits) & 1023
    v = np.float64(m) * 2.0 ** -24 if e == 0 else np.float64(m + 1024) * 2.0 ** (e - 25)
    return np.float32(-v if np.int64(bits) & 0x8000 else v)


@njit(cache=True, nogil=True)
def _find(keys, rows, scales, ids, out, shard, num_shards):
    """The rows of shard `shard`'s IDs among `ids` into `out` (zeros where its `keys` lack one), multiplied by
    their float16 scale (`scales`: its bits) when `scales` is not empty."""
    for i in range(ids.shape[0]):
        z = ids[i] + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
        if z % num_shards != shard:
            continue
        lo, hi = 0, keys.shape[0]
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] < ids[i]:
                lo = mid + 1
            else:
                hi = mid
        if lo < keys.shape[0] and keys[lo] == ids[i]:
            if scales.shape[0]:
                step = _half(scales[lo])
                for d in range(out.shape[1]):
                    out[i, d] = np.float32(rows[lo, d]) * step
            else:
                out[i, :] = rows[lo, :]
        else:
            out[i, :] = 0.0


def warm_up(quantized: bool = False) -> None:
    """Compile (or load from numba's cache) the kernel for every kind of array a lookup passes it: tables
    read-only (a bundle's, memory-mapped) or writable (a followed version's, merged in memory), and IDs read-only
    (views of a request's bytes) or writable. numba compiles one version per kind, at its first call: on the
    request path that was the event loop's thread compiling for seconds under load (a clean-clone CI saw the
    inference service answer nothing for 19 s after its first merged version), here it is at start."""
    out = np.empty((2, 2), np.float32)
    for tables_writable in (False, True):
        for ids_writable in (False, True):
            keys, rows, ids = np.arange(1, 4, dtype=np.uint64), np.ones((3, 2), np.float32), np.array([2, 9], np.uint64)
            keys.flags.writeable = rows.flags.writeable = tables_writable
            ids.flags.writeable = ids_writable
            lookup_into([keys], [rows], ids, out)
            if quantized:
                q, scales = np.ones((3, 2), np.int8), np.ones(3, np.float16)
                q.flags.writeable = scales.flags.writeable = tables_writable
                lookup_into([keys], [q], ids, out, [scales])
