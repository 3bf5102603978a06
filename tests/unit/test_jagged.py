"""KeyedBags, the batch form of the sparse features: each way of making one agrees with per-feature Bags."""
from __future__ import annotations

import numpy as np

from hybridrec.core.wire.jagged import Bag, KeyedBags


def _random_bags(rng, n: int, features: int) -> list[Bag]:
    bags = []
    for _ in range(features):
        lengths = rng.integers(0, 4, n)
        bags.append(Bag.from_lengths(rng.integers(0, 1000, int(lengths.sum())).astype(np.uint64), lengths))
    return bags


def _assert_same(keyed: KeyedBags, bags: list[Bag]) -> None:
    assert keyed.num_features == len(bags) and len(keyed) == len(bags[0])
    for f, want in enumerate(bags):
        got = keyed.bag(f)
        np.testing.assert_array_equal(got.values, want.values)
        np.testing.assert_array_equal(got.offsets, want.offsets)


def test_concat_is_the_per_feature_concatenation_of_the_parts():
    rng = np.random.default_rng(0)
    parts = [_random_bags(rng, int(rng.integers(1, 5)), 5) for _ in range(7)]
    merged = KeyedBags.concat([KeyedBags.from_bags(p) for p in parts])
    _assert_same(merged, [Bag.from_lengths(np.concatenate([p[f].values for p in parts]),
                                           np.concatenate([p[f].lengths for p in parts])) for f in range(5)])


def test_columns_are_bags_of_at_most_one_id():
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 1 << 60, (6, 4), dtype=np.uint64)
    present = rng.random((6, 4)) < 0.7
    keyed = KeyedBags.from_columns(ids, present)
    _assert_same(keyed, [Bag.from_column(ids[:, f], present[:, f]) for f in range(4)])
    assert keyed.lengths.max() <= 1 and keyed.values.shape[0] == present.sum()


def test_empty_bags_and_a_single_part_pass_through():
    bags = [Bag(np.zeros(0, np.uint64), np.zeros(4, np.int64)) for _ in range(3)]
    keyed = KeyedBags.from_bags(bags)
    assert KeyedBags.concat([keyed]) is keyed
    _assert_same(KeyedBags.concat([keyed, keyed]), [Bag(np.zeros(0, np.uint64), np.zeros(7, np.int64))] * 3)


def test_a_slice_is_each_features_slice():
    rng = np.random.default_rng(2)
    bags = _random_bags(rng, 9, 4)
    keyed = KeyedBags.from_bags(bags)
    for start, stop in ((0, 9), (2, 5), (4, 4), (8, 9)):
        _assert_same(keyed.slice(start, stop), [b.slice(start, stop) for b in bags])
