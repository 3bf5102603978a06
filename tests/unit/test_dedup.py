"""Hash-based dedup kernels against np.unique, and the embedding worker's single-dedup path."""
import numpy as np
import pytest

from hybridrec.core.wire.dedup import has_duplicates, unique_inverse, unique_segments
from hybridrec.core.wire.jagged import KeyedBags
from hybridrec.core.wire.frames import SparseBatch
from hybridrec.core.wire.ids import GROUP_SHIFT


def _check(values: np.ndarray, uniq: np.ndarray, inverse: np.ndarray) -> None:
    np.testing.assert_array_equal(np.sort(uniq), np.unique(values))  # the same set, each once
    np.testing.assert_array_equal(uniq[inverse], values)  # every value found again
    if values.size:  # first-occurrence order
        _, first = np.unique(values, return_index=True)
        np.testing.assert_array_equal(uniq, values[np.sort(first)])


@pytest.mark.parametrize("n, pool", [(0, 1), (1, 1), (7, 1), (4096, 50), (4096, 10**6), (5000, 2**64 - 1)])
def test_unique_inverse_matches_np_unique(n, pool):
    rng = np.random.default_rng(n)
    values = rng.integers(0, pool, size=n, dtype=np.uint64, endpoint=True)
    uniq, inverse = unique_inverse(values)
    assert inverse.dtype == np.int32 and uniq.dtype == np.uint64
    _check(values, uniq, inverse)


def test_unique_inverse_handles_keys_that_collide_in_the_table():
    values = (np.arange(3000, dtype=np.uint64) << np.uint64(52))  # same low bits: one probe chain
    uniq, inverse = unique_inverse(np.concatenate([values, values[::-1]]))
    _check(np.concatenate([values, values[::-1]]), uniq, inverse)


def test_unique_segments_matches_per_feature_np_unique():
    rng = np.random.default_rng(1)
    n, num = 4096, 26
    ids = (rng.zipf(1.3, size=(n, num)).astype(np.uint64) % np.uint64(5000)
           | (np.arange(num, dtype=np.uint64) << np.uint64(GROUP_SHIFT)))
    present = rng.random((n, num)) < 0.8
    present[:, 3] = False  # a feature with no ID at all
    keyed = KeyedBags.from_columns(ids, present)
    uniq, pos = unique_segments(keyed.values, keyed.bounds)
    assert pos.dtype == np.uint16 and pos.shape == keyed.values.shape
    for f in range(num):
        column = ids[present[:, f], f]
        _check(column, uniq[f], pos[keyed.bounds[f]:keyed.bounds[f + 1]].astype(np.int64))
    assert uniq[3].size == 0


def test_sparse_batch_from_columns_round_trips_and_refuses_too_many_unique():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 100, size=(64, 3), dtype=np.uint64)
    present = rng.random((64, 3)) < 0.5
    batch = SparseBatch.decode(SparseBatch.from_columns(ids, present, phase="train").encode(), 3)
    for f in range(3):
        np.testing.assert_array_equal(batch.ids(f).values, ids[present[:, f], f])
        np.testing.assert_array_equal(batch.bags.lengths[f], present[:, f])
    many = KeyedBags(np.arange(70_000, dtype=np.uint64), np.full((1, 10), 7_000))  # ten bags of 7,000 IDs
    with pytest.raises(ValueError, match="70000 distinct IDs in one feature"):
        SparseBatch.from_bags(many, phase="train")
    rows = np.arange(70_000, dtype=np.uint64)[:, None]
    with pytest.raises(ValueError, match="a batch of 70000 samples exceeds 65535"):
        SparseBatch.from_columns(rows, np.ones_like(rows, dtype=bool), phase="train")


def test_has_duplicates():
    assert not has_duplicates(np.zeros(0, np.uint64))
    assert not has_duplicates(np.arange(10_000, dtype=np.uint64) * np.uint64(2**40))
    values = np.arange(10_000, dtype=np.uint64)
    values[-1] = 17
    assert has_duplicates(values)
