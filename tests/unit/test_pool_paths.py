"""The two ways `Pooler.pool` pools: compiled kernels straight from the frame's arrays (the CPU) and
`embedding_bag` with its index built on the device (a GPU, exercised here on CPU tensors), through the
staging buffer a GPU batch travels in (services/nn_worker/feed.py). Same values, same gradients."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hybridrec.core.wire.compress import Fp16Rows, ValueCodec
from hybridrec.core.config import FeatureConfig, Pooling
from hybridrec.core.wire.frames import Embeddings
from hybridrec.core.model.models import DNN, feature_infos, side_by_side, vector
from hybridrec.core.model.pooling import PooledEmbeddings, Pooler
from services.nn_worker.feed import _arrays, _pack, _unpack
from tests.unit.test_pooling import _frame

CPU = torch.device("cpu")


def _features() -> list[FeatureConfig]:
    """Widths interleaved in config order (width 4's pooled features are not neighbours), every pooling, and a
    sequence among them."""
    return [FeatureConfig(name="a", group=0, dim=4, pooling=Pooling.SUM, kind="list", max_len=4),
            FeatureConfig(name="b", group=1, dim=3, pooling=Pooling.MEAN, kind="list", max_len=4),
            FeatureConfig(name="c", group=2, dim=4, pooling=Pooling.SQRTN, kind="list", max_len=4),
            FeatureConfig(name="s", group=3, dim=3, kind="list", pooling="none", max_len=4),
            FeatureConfig(name="d", group=4, dim=4, pooling=Pooling.MEAN, kind="list", max_len=4)]


def _batch(values: ValueCodec, seed: int = 0):
    features = _features()
    widths = [f.dim for f in features]
    raw, _, _ = _frame(widths, [6, 3, 0, 5, 4], 11, seed=seed)  # feature c: no rows, every bag empty
    frame = Embeddings.decode(raw, ValueCodec(fp16=False), widths, 11,  # bags of at most 4: the features' max_len
                              ids_per_sample=4 * len(widths))
    return features, frame.encode(values)


def _staged(emb):
    """The batch as the device path gets it: every array through the one staging buffer, as CPU tensors."""
    dense, labels = np.ones((emb.batch_size, 2), np.float32), np.zeros(emb.batch_size, np.float32)
    arrays = _arrays(dense, labels, emb)
    buffer, offsets = _pack(arrays, pin=False)
    return _unpack(buffer, offsets, arrays, emb)


@pytest.mark.parametrize("fp16", [False, True])
def test_kernels_and_embedding_bag_agree_forward_and_backward(fp16):
    values = ValueCodec(fp16=fp16)
    features, raw = _batch(values)
    pooler = Pooler(features, values)
    host = pooler.decode(raw, 11)
    assert isinstance(host.rows[4], Fp16Rows) == fp16 and not isinstance(host.pos, torch.Tensor)
    dense, labels, staged = _staged(host)
    assert isinstance(staged.pos, torch.Tensor) and torch.equal(dense, torch.ones(11, 2))
    results = []
    for emb in (host, staged):
        leaves, pooled = pooler.pool(emb, CPU, grad=True)
        weights = {name: torch.linspace(-1, 1, vector(t).numel()).reshape(vector(t).shape)
                   for name, t in pooled.items()}
        sum((vector(t) * weights[name]).sum() for name, t in pooled.items()).backward()
        results.append(({n: vector(t).detach() for n, t in pooled.items()}, {d: l.grad for d, l in leaves.items()}))
    (kernel, kernel_grads), (device, device_grads) = results
    assert list(kernel) == ["a", "b", "c", "s", "d"]
    for name in kernel:
        torch.testing.assert_close(kernel[name], device[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(kernel["c"].numpy(), 0)
    for dim in kernel_grads:
        torch.testing.assert_close(kernel_grads[dim], device_grads[dim], rtol=1e-5, atol=1e-6)


def test_a_block_is_handed_to_the_model_without_a_copy_and_the_dnn_computes_as_before():
    values = ValueCodec(fp16=False)
    features = [FeatureConfig(name=f"f{i}", group=i, dim=4, kind="list", max_len=4) for i in range(3)]
    raw, _, _ = _frame([4, 4, 4], [5, 3, 4], 9, seed=3)
    pooler = Pooler(features, values)
    _, pooled = pooler.pool(pooler.decode(raw, 9), CPU, grad=False)
    assert isinstance(pooled, PooledEmbeddings)
    block = pooled.blocks[0][1]
    joined = side_by_side(pooled, ["f0", "f1", "f2"])
    assert joined.data_ptr() == block.data_ptr() and joined.shape == (9, 12)  # the block itself
    torch.testing.assert_close(joined, torch.cat([pooled[n] for n in ("f0", "f1", "f2")], dim=1))
    torch.testing.assert_close(side_by_side(pooled, ["f1", "f0"]), torch.cat([pooled["f1"], pooled["f0"]], 1))

    model = DNN(features=feature_infos(features), num_dense=2, hidden=[5])
    dense = torch.randn(9, 2)
    plain = dict(pooled)  # a plain dict: concatenated as a model would
    first, *rest = model.net
    expected = torch.cat([dense, *(plain[n] for n in ("f0", "f1", "f2"))], 1) @ first.weight.T + first.bias
    for layer in rest:
        expected = layer(expected)
    torch.testing.assert_close(model(dense, pooled), expected.squeeze(-1))
    torch.testing.assert_close(model(dense, plain), expected.squeeze(-1))


def test_the_staging_buffer_keeps_every_array_aligned_and_intact():
    values = ValueCodec(fp16=True)
    features, raw = _batch(values, seed=5)
    emb = Pooler(features, values).decode(raw, 11)
    arrays = _arrays(np.arange(22, dtype=np.float32).reshape(11, 2), None, emb)
    buffer, offsets = _pack(arrays, pin=False)
    assert all(offset % 64 == 0 for offset in offsets.values())
    dense, labels, staged = _unpack(buffer, offsets, arrays, emb)
    assert labels is None and dense.numpy().tolist() == np.arange(22).reshape(11, 2).tolist()
    assert np.array_equal(staged.pos.numpy(), emb.pos) and np.array_equal(staged.lengths.numpy(), emb.lengths)
    for dim, rows in emb.rows.items():
        assert np.array_equal(staged.rows[dim].half.numpy(), rows.half)
        assert np.array_equal(staged.rows[dim].norms.numpy(), rows.norms)
    assert dataclasses.fields(staged) == dataclasses.fields(emb)


class _Uint16OnlyViewed(torch.overrides.TorchFunctionMode):
    """Fails any torch call other than a view, a slice or an attribute read that is handed a uint16 tensor:
    CUDA implements almost no operation for uint16 (indexing one raised `"index_cuda" not implemented for
    'UInt16'` on a GPU), so the device path must widen positions and lengths before it computes with them."""

    ALLOWED = {"view", "__get__", "__getitem__", "size", "dim", "numel", "data_ptr", "is_contiguous"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if name not in self.ALLOWED and any(t.dtype == torch.uint16 for t in tensors):
            raise AssertionError(f"torch.{name} on a uint16 tensor: CUDA has no kernel for it")
        if name == "__getitem__" and tensors[0].dtype == torch.uint16 and not isinstance(args[1], slice):
            raise AssertionError(f"a uint16 tensor indexed by {type(args[1]).__name__}: CUDA has no kernel for it")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fp16", [False, True])
def test_the_device_path_only_views_and_slices_uint16_arrays(fp16):
    values = ValueCodec(fp16=fp16)
    features, raw = _batch(values, seed=2)
    pooler = Pooler(features, values)
    host = pooler.decode(raw, 11)
    _, _, staged = _staged(host)
    assert staged.pos.dtype == torch.uint16 and staged.lengths.dtype == torch.uint16  # as the frame carried them
    expected = {n: vector(t) for n, t in pooler.pool(host, CPU, grad=False)[1].items()}
    with _Uint16OnlyViewed():
        leaves, pooled = pooler.pool(staged, CPU, grad=True)
        sum(vector(t).sum() for t in pooled.values()).backward()
    for name, tensor in pooled.items():
        torch.testing.assert_close(vector(tensor).detach(), expected[name], rtol=1e-5, atol=1e-6)
    assert all(leaf.grad is not None for leaf in leaves.values())
