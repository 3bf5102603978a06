"""The NN worker's Pooler: Embeddings frame -> pooled vector per (feature, sample), and its gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import FeatureConfig, Pooling
from hybridrec.core.wire.frames import Embeddings
from hybridrec.core.wire.jagged import KeyedBags
from hybridrec.core.model.pooling import Pooler

VALUES = ValueCodec(fp16=False)
CPU = torch.device("cpu")


def _features(poolings: list[Pooling], widths: list[int]) -> list[FeatureConfig]:
    """List features of bags up to 4 long (`_frame`'s)."""
    return [FeatureConfig(name=f"f{i}", group=i, dim=d, pooling=p, kind="list", max_len=4)
            for i, (p, d) in enumerate(zip(poolings, widths))]


def _frame(widths: list[int], counts: list[int], batch_size: int, seed: int):
    """A hand-built Embeddings frame and, per feature, its rows and bags (lists of positions) for the reference.

    Bag lengths 0..4, positions may repeat inside a bag; a feature with no rows has only empty bags.
    """
    rng = np.random.default_rng(seed)
    feature_rows, bags, lengths, pos = [], [], [], []
    for dim, count in zip(widths, counts):
        feature_rows.append(rng.standard_normal((count, dim)).astype(np.float32))
        n = rng.integers(0, 5, batch_size) if count else np.zeros(batch_size, np.int64)
        n[0] = 0  # at least one empty bag per feature
        if count:
            n[1] = 4
        f_bags = [rng.integers(0, count, k).tolist() if count else [] for k in n]
        if count:
            f_bags[1] = [0, 0, count - 1, 0]  # a repeated row inside one bag
        bags.append(f_bags)
        lengths.append(np.array([len(b) for b in f_bags], np.uint16))
        pos.append(np.array([p for b in f_bags for p in b], np.uint16))
    rows = {d: np.concatenate([r for r, w in zip(feature_rows, widths) if w == d]) for d in sorted(set(widths))}
    frame = Embeddings(bags=KeyedBags(np.concatenate(pos), np.stack(lengths)), counts=np.array(counts, np.int32),
                       rows=rows)
    return frame.encode(VALUES, lz4=True), feature_rows, bags


def _weight(pooling: Pooling, n: int) -> float:
    if n == 0:
        return 0.0
    return {Pooling.SUM: 1.0, Pooling.MEAN: 1.0 / n, Pooling.SQRTN: 1.0 / np.sqrt(n)}[pooling]


def _reference(features, feature_rows, bags) -> dict[str, np.ndarray]:
    out = {}
    for f, feature in enumerate(features):
        pooled = np.zeros((len(bags[f]), feature.dim), np.float64)
        for i, bag in enumerate(bags[f]):
            for p in bag:
                pooled[i] += feature_rows[f][p].astype(np.float64) * _weight(feature.pooling, len(bag))
        out[feature.name] = pooled
    return out


def _reference_grads(features, counts, bags) -> dict[int, np.ndarray]:
    """d(sum of every pooled value)/d(leaf row): the (weighted) number of times each unique row is used."""
    per_feature = []
    for f, feature in enumerate(features):
        g = np.zeros((counts[f], feature.dim), np.float64)
        for bag in bags[f]:
            for p in bag:
                g[p] += _weight(feature.pooling, len(bag))
        per_feature.append(g)
    widths = [f.dim for f in features]
    return {d: np.concatenate([g for g, w in zip(per_feature, widths) if w == d]) for d in sorted(set(widths))}


CASES = {
    "sum": ([Pooling.SUM] * 4, [4, 4, 3, 3]),
    "mean": ([Pooling.MEAN] * 4, [4, 4, 3, 3]),
    "sqrtn": ([Pooling.SQRTN] * 4, [4, 4, 3, 3]),
    "mixed": ([Pooling.SUM, Pooling.MEAN, Pooling.SQRTN, Pooling.MEAN], [4, 3, 4, 3]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pool_equals_numpy_reference_and_gradients_count_uses(case):
    poolings, widths = CASES[case]
    features = _features(poolings, widths)
    counts = [5, 0, 7, 3]  # feature 1 has no rows at all (every bag empty)
    batch_size = 9
    raw, feature_rows, bags = _frame(widths, counts, batch_size, seed=len(case))
    pooler = Pooler(features, VALUES)
    assert pooler.weighted == (case != "sum")

    emb = pooler.decode(raw, batch_size)
    leaves, pooled = pooler.pool(emb, CPU, grad=True)

    assert list(pooled) == [f.name for f in features]  # config order
    expected = _reference(features, feature_rows, bags)
    for feature in features:
        got = pooled[feature.name]
        assert got.shape == (batch_size, feature.dim)
        np.testing.assert_allclose(got.detach().numpy(), expected[feature.name], rtol=1e-5, atol=1e-6,
                                   err_msg=feature.name)
        np.testing.assert_array_equal(got.detach().numpy()[0], 0)  # sample 0's bags are empty

    sum(p.sum() for p in pooled.values()).backward()
    expected_grads = _reference_grads(features, counts, bags)
    assert sorted(leaves) == sorted(expected_grads)
    for dim, leaf in leaves.items():
        assert leaf.is_leaf and leaf.grad is not None
        assert leaf.shape == (sum(c for c, w in zip(counts, widths) if w == dim), dim)
        np.testing.assert_allclose(leaf.grad.numpy(), expected_grads[dim], rtol=1e-6, atol=1e-7)


def test_pooling_matters():
    """The same frame pooled three ways gives three different answers (mean and sqrt-n really divide)."""
    widths, counts, batch_size = [4], [6], 8
    raw, feature_rows, bags = _frame(widths, counts, batch_size, seed=11)
    out = {}
    for pooling in (Pooling.SUM, Pooling.MEAN, Pooling.SQRTN):
        pooler = Pooler(_features([pooling], widths), VALUES)
        out[pooling] = pooler.pool(pooler.decode(raw, batch_size), CPU, grad=False)[1]["f0"].numpy()
    n = np.array([len(b) for b in bags[0]], np.float32)
    many = n > 1
    assert many.any()
    np.testing.assert_allclose(out[Pooling.MEAN][many] * n[many, None], out[Pooling.SUM][many], rtol=1e-5)
    np.testing.assert_allclose(out[Pooling.SQRTN][many] * np.sqrt(n[many, None]), out[Pooling.SUM][many], rtol=1e-5)
    assert not np.allclose(out[Pooling.MEAN][many], out[Pooling.SUM][many])


def test_pool_without_grad_gives_plain_tensors():
    features = _features([Pooling.MEAN, Pooling.SUM], [4, 4])
    raw, _, _ = _frame([4, 4], [3, 3], 5, seed=2)
    pooler = Pooler(features, VALUES)
    leaves, pooled = pooler.pool(pooler.decode(raw, 5), CPU, grad=False)
    assert not leaves[4].requires_grad and not any(p.requires_grad for p in pooled.values())


def test_decode_refuses_a_frame_for_another_batch_size():
    features = _features([Pooling.SUM] * 2, [4, 4])
    raw, _, _ = _frame([4, 4], [3, 3], 5, seed=3)
    with pytest.raises(ValueError):
        Pooler(features, VALUES).decode(raw, 6)


@pytest.mark.parametrize("weighted", [False, True])
def test_empty_batch_pools_to_zeros(weighted):
    poolings = [Pooling.SUM, Pooling.MEAN if weighted else Pooling.SUM, Pooling.SUM]
    features = _features(poolings, [4, 3, 4])
    pooler = Pooler(features, VALUES)
    emb = pooler.empty(7)
    leaves, pooled = pooler.pool(emb, CPU, grad=True)
    assert list(pooled) == ["f0", "f1", "f2"]
    for feature in features:
        got = pooled[feature.name]
        assert got.shape == (7, feature.dim)
        np.testing.assert_array_equal(got.detach().numpy(), 0)
    assert {d: tuple(leaf.shape) for d, leaf in leaves.items()} == {3: (0, 3), 4: (0, 4)}
    sum(p.sum() for p in pooled.values()).backward()  # a lost batch still trains the dense part
    assert all(leaf.grad.shape == leaf.shape for leaf in leaves.values())
