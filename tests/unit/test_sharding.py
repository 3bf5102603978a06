"""hybridrec.core.wire.sharding: which PS shard owns an ID (splitmix64 mod num_shards) and the split of a batch by
shard."""
from __future__ import annotations

import numpy as np
import pytest

from hybridrec.core.wire.ids import GROUP_SHIFT, MAX_GROUPS
from hybridrec.core.wire.sharding import shard_of, split_by_shard, splitmix64

MASK = (1 << 64) - 1
EDGES = [0, 1, 2, 3, 2**32 - 1, 2**32, 2**56, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]


def _splitmix64_reference(x: int) -> int:
    """splitmix64's finaliser in plain Python integers (Steele, Lea & Flood 2014; Vigna's C reference)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_reference_is_splitmix64():
    # The first output of Vigna's splitmix64 seeded with 0 (its state advances by the golden gamma first).
    assert _splitmix64_reference(0) == 0xE220A8397B1DCDAF


def test_splitmix64_matches_the_reference_on_edge_values():
    got = splitmix64(np.array(EDGES, np.uint64))
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [_splitmix64_reference(x) for x in EDGES]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 16, 1000])
def test_shard_of_matches_the_reference_and_is_deterministic(num_shards):
    rng = np.random.default_rng(num_shards)
    ids = np.concatenate([np.array(EDGES, np.uint64), rng.integers(0, 2**64 - 1, 500, dtype=np.uint64, endpoint=True)])
    got = shard_of(ids, num_shards)
    assert got.dtype == np.int64 and got.shape == ids.shape
    assert got.tolist() == [_splitmix64_reference(int(x)) % num_shards for x in ids]
    np.testing.assert_array_equal(shard_of(ids.copy(), num_shards), got)  # same answer every call
    np.testing.assert_array_equal(shard_of(ids[::-1], num_shards), got[::-1])  # per ID, not per position
    assert ((got >= 0) & (got < num_shards)).all()


def test_shard_of_takes_python_ints_above_int64():
    assert shard_of([2**64 - 1, 2**63], 5).tolist() == [_splitmix64_reference(2**64 - 1) % 5,
                                                       _splitmix64_reference(2**63) % 5]


def _chi_square(shards: np.ndarray, num_shards: int) -> float:
    counts = np.bincount(shards, minlength=num_shards)
    expected = shards.size / num_shards
    return float(((counts - expected) ** 2 / expected).sum())


def _bound(num_shards: int) -> float:
    """Far tail of chi-square with num_shards-1 degrees of freedom: mean + 8 standard deviations."""
    df = num_shards - 1
    return df + 8 * np.sqrt(2 * df)


@pytest.mark.parametrize("num_shards", [2, 4, 7, 16])
def test_ids_of_one_group_spread_evenly(num_shards):
    """100k IDs of one hot group, with structured low bits (multiples of 1024): an unhashed `id % n` would put
    them all on shard 0 for a power-of-two n."""
    ids = (np.uint64(5) << np.uint64(GROUP_SHIFT)) | (np.arange(100_000, dtype=np.uint64) * np.uint64(1024))
    chi2 = _chi_square(shard_of(ids, num_shards), num_shards)
    assert chi2 < _bound(num_shards), f"chi-square {chi2:.1f} over {num_shards} shards"


@pytest.mark.parametrize("num_shards", [2, 4, 16])
def test_ids_differing_only_in_group_bits_spread_evenly(num_shards):
    """The same 56-bit value in every one of the 256 groups, for 400 values: ~100k IDs whose groups differ."""
    values = np.arange(1, 401, dtype=np.uint64) * np.uint64(977)
    groups = np.arange(MAX_GROUPS, dtype=np.uint64) << np.uint64(GROUP_SHIFT)
    ids = (groups[:, None] | values[None, :]).reshape(-1)
    assert ids.size == 102_400 and np.unique(ids).size == ids.size
    shards = shard_of(ids, num_shards)
    chi2 = _chi_square(shards, num_shards)
    assert chi2 < _bound(num_shards), f"chi-square {chi2:.1f} over {num_shards} shards"
    # Per value, its 256 group variants are not stuck on one shard either.
    per_value = shards.reshape(MAX_GROUPS, -1)
    assert all(np.unique(per_value[:, j]).size == num_shards for j in range(per_value.shape[1]))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
def test_split_by_shard_partitions_positions(num_shards):
    rng = np.random.default_rng(num_shards)
    ids = rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=True)
    ids[100:110] = ids[0]  # duplicates go with their ID
    parts = split_by_shard(ids, num_shards)
    assert len(parts) == num_shards
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(ids.size))  # each position once
    owner = shard_of(ids, num_shards)
    for shard, positions in enumerate(parts):
        assert np.issubdtype(positions.dtype, np.integer)
        assert (owner[positions] == shard).all()
        assert (np.diff(positions) > 0).all()  # order preserved within a shard
        np.testing.assert_array_equal(positions, np.flatnonzero(owner == shard))
    if num_shards > 1:
        assert all(p.size for p in parts)


def test_split_by_shard_groups_stay_with_their_shard():
    """All of a group's IDs that hash to shard s are in part s (groups are not a unit of placement)."""
    ids = (np.repeat(np.arange(4, dtype=np.uint64), 50) << np.uint64(GROUP_SHIFT)) | np.tile(
        np.arange(50, dtype=np.uint64), 4)
    parts = split_by_shard(ids, 3)
    for shard, positions in enumerate(parts):
        np.testing.assert_array_equal(shard_of(ids[positions], 3), shard)
    # every group lands on more than one shard: hashing spreads a hot group
    groups = ids >> np.uint64(GROUP_SHIFT)
    for g in range(4):
        assert sum(bool((groups[p] == g).any()) for p in parts) > 1


def test_split_by_shard_of_no_ids():
    parts = split_by_shard(np.zeros(0, np.uint64), 3)
    assert len(parts) == 3 and all(p.size == 0 for p in parts)


@pytest.mark.parametrize("num_shards", [0, -1])
def test_non_positive_num_shards_is_refused(num_shards):
    ids = np.arange(10, dtype=np.uint64)
    with pytest.raises(ValueError, match="num_shards"):
        shard_of(ids, num_shards)
    with pytest.raises(ValueError, match="num_shards"):
        split_by_shard(ids, num_shards)
