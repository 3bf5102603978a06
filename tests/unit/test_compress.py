"""ID dedup with uint16 positions and kappa-scaled fp16 values."""
import numpy as np
import pytest

from hybridrec.core.wire.compress import ValueCodec, scaled_fp16, unscale_fp16
from hybridrec.core.wire.frames import SparseBatch
from hybridrec.core.wire.jagged import KeyedBags


def test_dedup_is_lossless():
    ids = np.random.default_rng(0).zipf(1.2, size=4096).astype(np.uint64) % 1000
    batch = SparseBatch.from_bags(KeyedBags(ids, np.ones((1, 4096), np.int64)), phase="train")
    assert batch.bags.values.dtype == np.uint16
    np.testing.assert_array_equal(batch.ids(0).values, ids)


def test_dedup_rejects_more_than_65535_unique():
    with pytest.raises(ValueError, match="uint16"):
        SparseBatch.from_bags(KeyedBags(np.arange(70000, dtype=np.uint64), np.full((1, 10), 7000)), phase="train")


def test_kappa_fp16_keeps_tiny_gradients_that_a_plain_cast_flushes():
    rng = np.random.default_rng(1)
    grads = (rng.standard_normal((1000, 16)) * 1e-9).astype(np.float32)
    half, norms = scaled_fp16(grads, 1024.0)
    restored = unscale_fp16(half, norms, 1024.0)
    rel_kappa = np.abs(restored - grads).max() / np.abs(grads).max()
    plain = grads.astype(np.float16).astype(np.float32)
    assert not plain.any()  # a plain cast loses everything
    assert rel_kappa < 2e-3


def test_value_codec_round_trip_and_zero_vectors():
    vc = ValueCodec(fp16=True, kappa=1024.0)
    x = np.random.default_rng(2).standard_normal((8, 32)).astype(np.float32)
    x[3] = 0
    tensors = vc.pack("v", x, 16)
    assert tensors["v"].dtype == np.float16 and tensors["v.norm"].shape == (16,)
    out = vc.unpack(tensors, "v", 16)
    np.testing.assert_allclose(out, x, rtol=0, atol=np.abs(x).max() * 1e-3)
    assert not out[3].any()
    plain = ValueCodec(fp16=False)
    np.testing.assert_array_equal(plain.unpack(plain.pack("v", x, 16), "v", 16), x)


def test_value_codec_rejects_inconsistent_norms():
    vc = ValueCodec()
    tensors = vc.pack("v", np.ones((4, 8), np.float32), 8)
    tensors["v.norm"] = tensors["v.norm"][:2]
    with pytest.raises(ValueError, match="norms"):
        vc.unpack(tensors, "v", 8)
