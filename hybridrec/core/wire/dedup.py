"""Hash-based ID deduplication: compiled loops that replace sort-based `np.unique` on the data path.

A batch's IDs are deduplicated once, in the data loader (`unique_segments`,
every feature of a batch's `KeyedBags` in one call): each
feature travels as its unique IDs plus a position per occurrence, and every
later stage works from those (the embedding worker merges features of one
width only where they can share IDs, `hybridrec.core.wire.frames.SparseBatch`'s
producer guarantees nothing more). The PS checks that an update's IDs are
unique with `has_duplicates`.

Why hashing and not `np.unique`: `np.unique(return_inverse=True)` sorts
(an argsort of n keys, then a scatter back) and allocates several arrays per
call; an open-addressing table sized to twice the batch finds each ID's
slot in about one probe, so a batch's 26 features cost one compiled call
instead of 26 sorts. The IDs are hashes already (`hybridrec.core.wire.ids`), so a
multiplicative hash of them spreads well. Unique IDs come out in order of
first occurrence, not sorted: nothing downstream depends on the order, and
it is deterministic for the same input.
"""
from __future__ import annotations

import numpy as np

from hybridrec.core.runtime.kernel_cache import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(inline="always")
def _table_bits(n: int) -> int:
    """log2 of a power-of-two table size of at least 2n (at least 16 slots)."""
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    return bits


@njit(inline="always")
def _slot(key: np.uint64, shift: np.uint64, mask: int) -> int:
    return int((key * _GOLDEN) >> shift) & mask


@njit(nogil=True, cache=True)
def _unique_into(values, table, keys, uniq, inverse, bits) -> int:
    """Fill uniq[:k] (first-occurrence order) and inverse (index into uniq); return k. `table` is -1 filled."""
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    k = 0
    for i in range(values.shape[0]):
        key = values[i]
        s = _slot(key, shift, mask)
        while True:
            at = table[s]
            if at < 0:
                table[s] = k
                keys[s] = key
                uniq[k] = key
                inverse[i] = k
                k += 1
                break
            if keys[s] == key:
                inverse[i] = at
                break
            s = (s + 1) & mask
    return k


@njit(nogil=True, cache=True)
def _unique_inverse(values):
    n = values.shape[0]
    bits = _table_bits(n)
    table = np.full(1 << bits, -1, np.int32)
    keys = np.empty(1 << bits, np.uint64)
    uniq = np.empty(n, np.uint64)
    inverse = np.empty(n, np.int32)
    k = _unique_into(values, table, keys, uniq, inverse, bits)
    return uniq[:k].copy(), inverse


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique values in first-occurrence order, int32 index of each value's unique entry)."""
    return _unique_inverse(np.ascontiguousarray(values, dtype=np.uint64))


@njit(nogil=True, cache=True)
def _unique_segments(values, bounds):
    """Per segment f (values[bounds[f]:bounds[f + 1]]): its uniques, concatenated over segments with offsets,
    and each value's position among its segment's uniques."""
    num = bounds.shape[0] - 1
    longest = 0
    for f in range(num):
        longest = max(longest, bounds[f + 1] - bounds[f])
    bits = _table_bits(longest)
    table = np.empty(1 << bits, np.int32)
    keys = np.empty(1 << bits, np.uint64)
    inverse = np.empty(longest, np.int32)
    uniq_all = np.empty(values.shape[0], np.uint64)
    uniq_off = np.zeros(num + 1, np.int64)
    pos_all = np.empty(values.shape[0], np.uint16)
    for f in range(num):
        lo, hi = bounds[f], bounds[f + 1]
        table[:] = -1
        u0 = uniq_off[f]
        k = _unique_into(values[lo:hi], table, keys, uniq_all[u0:u0 + hi - lo], inverse, bits)
        for i in range(hi - lo):
            pos_all[lo + i] = inverse[i]
        uniq_off[f + 1] = u0 + k
    return uniq_all, uniq_off, pos_all


def unique_segments(values: np.ndarray, bounds: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Per feature of a `hybridrec.core.wire.jagged.KeyedBags` (values feature-major, feature f at
    values[bounds[f]:bounds[f + 1]]): its unique IDs, and every value's uint16 position among them.

    One compiled call for every feature; the uniques are views of one array. The caller checks that no
    feature has more unique IDs than uint16 positions can address."""
    uniq_all, uniq_off, pos = _unique_segments(np.ascontiguousarray(values, dtype=np.uint64),
                                               np.ascontiguousarray(bounds, dtype=np.int64))
    return [uniq_all[uniq_off[f]:uniq_off[f + 1]] for f in range(bounds.shape[0] - 1)], pos


@njit(nogil=True, cache=True)
def _has_duplicates(values) -> bool:
    n = values.shape[0]
    bits = _table_bits(n)
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    used = np.zeros(1 << bits, np.bool_)
    keys = np.empty(1 << bits, np.uint64)
    for i in range(n):
        key = values[i]
        s = _slot(key, shift, mask)
        while used[s]:
            if keys[s] == key:
                return True
            s = (s + 1) & mask
        used[s] = True
        keys[s] = key
    return False


def has_duplicates(values: np.ndarray) -> bool:
    """Whether any value occurs twice (one hashed pass, no sort)."""
    return bool(_has_duplicates(np.ascontiguousarray(values, dtype=np.uint64)))
