"""Compact rows: 16-bit weights (fp16, bf16) with stochastic rounding, and row-wise Adagrad, in a real store."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig
from services.embedding_ps import row_storage as R
from services.embedding_ps.store import EmbeddingStore, StoreConfig, init_rows

KEYS = np.arange(7, 7 + 3000, dtype=np.uint64)


@njit
def _decode_all(bits, storage):
    out = np.empty(bits.shape[0], np.float32)
    for i in range(bits.shape[0]):
        out[i] = R.decode16(bits[i], storage)
    return out


@njit
def _encode_all(x, u, storage):
    out = np.empty(x.shape[0], np.uint16)
    for i in range(x.shape[0]):
        out[i] = R.encode16(x[i], u[i], storage)
    return out


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def test_decoding_matches_numpy_for_every_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    half = bits.view(np.float16).astype(np.float32)
    got = _decode_all(bits, R.FP16)
    finite = np.isfinite(half)
    np.testing.assert_array_equal(got[finite], half[finite])
    assert np.isnan(got[np.isnan(half)]).all() and np.array_equal(got[np.isinf(half)], half[np.isinf(half)])
    brain = _bf16(bits)
    finite = np.isfinite(brain)
    np.testing.assert_array_equal(_decode_all(bits, R.BF16)[finite], brain[finite])


@pytest.mark.parametrize("storage", [R.FP16, R.BF16])
def test_rounding_to_nearest_and_saturation(storage):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 5, 20000),
                        [0.0, -0.0, 1e-30, 7e4, -7e4, 3.4e38, -3.4e38]]).astype(np.float32)
    nearest = _encode_all(x, np.full(x.shape, 0.5), storage)
    back = _decode_all(nearest, storage)
    words = R.encode_weights(x[:, None], storage)  # numpy: round to nearest even
    reference = R.decode_weights(words, 1, storage)[:, 0]
    # equal but on exact ties (half up here, to even in numpy), which random floats almost never hit
    assert np.mean(back == reference) > 0.999
    limit = 65504.0 if storage == R.FP16 else float(_bf16(np.array([0x7F7F], np.uint16))[0])
    assert back[-2] == limit and back[-1] == -limit
    if storage == R.FP16:
        assert back[-4] == limit and back[-3] == -limit
    assert np.isfinite(back).all()


@pytest.mark.parametrize("storage", [R.FP16, R.BF16])
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(storage):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(300) * 0.02).astype(np.float32)
    x[:20] = (rng.standard_normal(20) * 1e-6).astype(np.float32)  # fp16's subnormals
    grid = (np.arange(4096) + 0.5) / 4096  # u over [0, 1), evenly
    for value in x:
        draws = _decode_all(_encode_all(np.full(4096, value, np.float32), grid, storage), storage)
        assert len(np.unique(draws)) <= 2
        lower, upper = draws.min(), draws.max()
        assert lower <= value <= upper
        ulp = max(float(upper - lower), 1e-45)
        assert abs(float(draws.astype(np.float64).mean()) - float(value)) <= ulp / 4096 + 1e-12


@njit
def _rows_both_ways(halves, x, random16, storage):
    """Row by row: (decode_row16, decode16_bits each, encode_row16, encode16_bits each)."""
    n, dim = x.shape
    dec_row = np.empty((n, dim), np.uint32)
    dec_one = np.empty((n, dim), np.uint32)
    enc_row = np.empty((n, dim), np.uint16)
    enc_one = np.empty((n, dim), np.uint16)
    for i in range(n):
        R.decode_row16(halves[i], dec_row[i], dim, storage)
        bits = x[i].view(np.uint32)
        R.encode_row16(bits, x[i], random16[i], enc_row[i], dim, storage)
        for d in range(dim):
            dec_one[i, d] = R.decode16_bits(halves[i, d], storage)
            enc_one[i, d] = R.encode16_bits(bits[d], x[i, d], random16[i, d], storage)
    return dec_row, dec_one, enc_row, enc_one


@pytest.mark.parametrize("storage", [R.FP16, R.BF16])
def test_whole_row_coding_equals_the_element_by_element_one(storage):
    """The update's and lookup's row passes (branch-free when every weight is a normal of the format) give the
    same bit patterns as the element-wise functions, also for rows with a zero, a subnormal, an inf, a NaN or
    a weight past the format's range in them."""
    rng = np.random.default_rng(5)
    n, dim = 4000, 16
    halves = rng.integers(0, 1 << 16, (n, dim)).astype(np.uint16)
    halves[: n // 2] = R.encode_weights(rng.standard_normal((n // 2, dim)).astype(np.float32) * 0.05,
                                        storage).view(np.uint16)[:, :dim]  # trained-like rows: all normal
    x = (rng.standard_normal((n, dim)) * 0.05).astype(np.float32)
    specials = np.array([0.0, -0.0, 1e-6, -3e-8, 7e4, -1e5, np.inf, np.nan, 1e-40, 3.4e38], np.float32)
    x[n // 2:, 3] = specials[rng.integers(0, specials.size, n - n // 2)]
    random16 = rng.integers(0, 1 << 16, (n, dim)).astype(np.uint16)
    dec_row, dec_one, enc_row, enc_one = _rows_both_ways(halves, x, random16, storage)
    np.testing.assert_array_equal(dec_row, dec_one)
    np.testing.assert_array_equal(enc_row, enc_one)


def _store(tmp_path, name: str, storage: str, opt: EmbeddingOptimizerConfig, dim: int = 16) -> EmbeddingStore:
    ps = PSConfig(capacity=2 * KEYS.size, num_stripes=4, storage=storage, init={"scale": 0.05})
    return EmbeddingStore.open(tmp_path / name, StoreConfig(dim=dim, optimizer=opt, ps=ps, seed=3))


def test_rowwise_adagrad_is_fbgemms_formula(tmp_path):
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1, eps=1e-8, weight_decay=0.01,
                                   initial_accumulator_value=0.2)
    store = _store(tmp_path, "rw", "fp32", opt, dim=6)
    ids = KEYS[:50]
    w = store.lookup(ids, train=True).astype(np.float64)
    acc = np.full(50, 0.2)
    rng = np.random.default_rng(3)
    for _ in range(5):
        g = (rng.standard_normal((50, 6)) * 0.3).astype(np.float32)
        store.update(ids, g)
        g64 = g + 0.01 * w
        acc += (g64 ** 2).mean(axis=1)
        w -= 0.1 / (np.sqrt(acc) + 1e-8)[:, None] * g64
    got, state = store.peek(ids)[0], store.peek(ids, state=True)[0]
    np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(state[:, 6], acc, rtol=1e-6)
    assert store.config.row_width == 7
    store.close()


@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_a_16_bit_store_trains_as_fp32_does_within_its_rounding(tmp_path, storage):
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    compact, full = _store(tmp_path, "c", storage, opt), _store(tmp_path, "f", "fp32", opt)
    code = R.STORAGE_CODES[compact.config.ps.storage]
    assert compact.config.row_width == 9 and full.config.row_width == 17
    start = compact.lookup(KEYS, train=True)
    np.testing.assert_array_equal(start, init_rows(KEYS, dim=16, seed=3, distribution="uniform", scale=0.05,
                                                   storage=code))
    full.load_rows(KEYS, np.hstack([start, np.zeros((KEYS.size, 1), np.float32)]))
    rng = np.random.default_rng(4)
    for _ in range(20):
        g = (rng.standard_normal((KEYS.size, 16)) * 0.1).astype(np.float32)
        assert compact.update(KEYS, g) == full.update(KEYS, g) == KEYS.size
    a, b = compact.lookup(KEYS, train=False), full.lookup(KEYS, train=False)
    ulp = 2.0 ** -10 if storage == "fp16" else 2.0 ** -7
    assert np.abs(a - b).max() < 20 * ulp * np.abs(b).max()  # 20 steps, each within one ulp
    assert abs(float((a - b).mean())) < 0.05 * float(np.abs(a - b).mean()) + 1e-9  # no drift either way
    compact.close()
    full.close()


def test_updates_smaller_than_an_ulp_still_move_fp16_weights_on_average(tmp_path):
    """Round to nearest would leave every weight where it is; stochastic rounding moves them as fp32 does."""
    opt = EmbeddingOptimizerConfig(name="sgd", lr=1.0)
    compact, full = _store(tmp_path, "c", "fp16", opt), _store(tmp_path, "f", "fp32", opt)
    start = compact.lookup(KEYS, train=True)
    full.load_rows(KEYS, start.copy())
    step = np.float32(2.0 ** -18)  # weights near 0.03 have an fp16 ulp of 2**-16: a step is a quarter of it
    g = np.full((KEYS.size, 16), step, np.float32)
    for _ in range(40):
        compact.update(KEYS, g)
        full.update(KEYS, g)
    moved_fp16 = float((start - compact.lookup(KEYS, train=False)).mean())
    moved_fp32 = float((start - full.lookup(KEYS, train=False)).mean())
    assert moved_fp32 == pytest.approx(40 * float(step), rel=1e-3)
    assert moved_fp16 == pytest.approx(moved_fp32, rel=0.02)
    compact.close()
    full.close()


def test_a_16_bit_store_reproduces_bit_for_bit(tmp_path):
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    runs = []
    for name in ("a", "b"):
        store = _store(tmp_path, name, "fp16", opt)
        store.lookup(KEYS, train=True)
        rng = np.random.default_rng(5)
        for _ in range(5):
            store.update(KEYS, (rng.standard_normal((KEYS.size, 16)) * 0.1).astype(np.float32))
        runs.append(store.peek(KEYS, state=True)[0])
        store.close()
    np.testing.assert_array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))


@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_a_16_bit_store_gives_each_row_its_own_result_in_any_order(tmp_path, storage):
    """A 16-bit lookup asks for rows a few IDs ahead and an update fetches the next block of rows while it steps
    one: neither may mix rows up. The same batches in another order (so each row falls in another block, at
    another position, beside absent IDs) give every row the same weights and state bit for bit, and every
    lookup the rows one ID at a time reads."""
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    stores = [_store(tmp_path, name, storage, opt) for name in ("a", "b")]
    absent = np.arange(10_000, 10_500, dtype=np.uint64)
    batch = np.concatenate([KEYS, absent])
    rng = np.random.default_rng(6)
    for store in stores:
        store.lookup(KEYS, train=True)
    for _ in range(3):
        g = (rng.standard_normal((batch.size, 16)) * 0.1).astype(np.float32)
        order = rng.permutation(batch.size)
        assert stores[0].update(batch, g) == stores[1].update(batch[order], g[order]) == KEYS.size
    a, b = (store.peek(KEYS, state=True)[0] for store in stores)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    order = rng.permutation(batch.size)
    read = stores[1].lookup(batch[order], train=False)
    one_by_one = np.vstack([stores[1].lookup(batch[order][i:i + 1], train=False) for i in range(batch.size)])
    np.testing.assert_array_equal(read.view(np.uint32), one_by_one.view(np.uint32))
    np.testing.assert_array_equal(read[np.argsort(order)][:KEYS.size], stores[0].peek(KEYS)[0])
    for store in stores:
        store.close()


def test_reattaching_with_another_storage_is_refused_naming_both(tmp_path):
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad")
    _store(tmp_path, "s", "fp16", opt).close()
    with pytest.raises(ValueError, match=r"weight storage \(ps.storage\)=fp16.*weight storage \(ps.storage\)=bf16"):
        _store(tmp_path, "s", "bf16", opt)


def _restored(tmp_path, source: EmbeddingStore, name: str, storage: str, opt: EmbeddingOptimizerConfig,
              step: int) -> EmbeddingStore:
    from hybridrec.core.wire.sharding import shard_of
    from services.embedding_ps.checkpoint import dump_shard, load_shard

    dump_shard({16: source}, tmp_path / f"ckpt-{name}", shard=0, num_shards=1, step=step)
    target = _store(tmp_path, name, storage, opt)
    load_shard(tmp_path / f"ckpt-{name}", {16: target}, shard=0, num_shards=1, shard_of=lambda i: shard_of(i, 1))
    return target


def test_checkpoints_restore_across_storage_types_both_ways(tmp_path):
    """fp32 -> fp16 -> fp32: every weight within fp16's rounding of the original (to nearest: half an ulp),
    the optimizer state unchanged; Adagrad's per-weight sums become row-wise Adagrad's by their row mean."""
    adagrad = EmbeddingOptimizerConfig(name="adagrad", lr=0.05)
    original = _store(tmp_path, "orig", "fp32", adagrad)
    original.lookup(KEYS, train=True)
    rng = np.random.default_rng(6)
    for _ in range(3):
        original.update(KEYS, (rng.standard_normal((KEYS.size, 16)) * 0.2).astype(np.float32))
    weights, rows = original.peek(KEYS)[0], original.peek(KEYS, state=True)[0]
    half = _restored(tmp_path, original, "half", "fp16", adagrad, step=1)
    back = _restored(tmp_path, half, "back", "fp32", adagrad, step=2)
    ulp = np.spacing(np.abs(weights).astype(np.float16)).astype(np.float32)
    for store in (half, back):
        got, found = store.peek(KEYS)
        assert found.all()
        assert (np.abs(got - weights) <= ulp / 2).all()
    np.testing.assert_array_equal(half.peek(KEYS)[0], back.peek(KEYS)[0])  # fp16 values are exact in fp32
    np.testing.assert_array_equal(back.peek(KEYS, state=True)[0][:, 16:], rows[:, 16:])
    rowwise = _restored(tmp_path, original, "rowwise", "fp16", EmbeddingOptimizerConfig(name="rowwise_adagrad"),
                        step=3)
    np.testing.assert_allclose(rowwise.peek(KEYS, state=True)[0][:, 8], rows[:, 16:].mean(axis=1), rtol=1e-6)
    for store in (original, half, back, rowwise):
        store.close()


def test_a_checkpoint_no_conversion_is_defined_for_is_refused_naming_both(tmp_path):
    from services.embedding_ps.checkpoint import dump_shard, load_shard

    source = _store(tmp_path, "rw", "fp16", EmbeddingOptimizerConfig(name="rowwise_adagrad"))
    source.lookup(KEYS[:10], train=True)
    dump_shard({16: source}, tmp_path / "ckpt", shard=0, num_shards=1, step=1)
    target = _store(tmp_path, "ada", "fp32", EmbeddingOptimizerConfig(name="adagrad"))
    with pytest.raises(ValueError, match="checkpoint holds rowwise_adagrad rows of fp16 weights .* the store "
                                         r"adagrad rows of fp32 weights .*optimizer.embedding.name"):
        load_shard(tmp_path / "ckpt", {16: target}, shard=0, num_shards=1, shard_of=lambda i: i * 0)
    assert target.num_rows == 0
    source.close()
    target.close()
