"""The layout a receiver process writes for its trainer (hybridrec/core/layouts/slot_layouts.py): a checked `Embeddings`
frame's arrays as they came, with what pooling derives from them; round trip, and refusal of a buffer that is
not one (truncated or mutated: a view within the buffer or ValueError, nothing else)."""
from __future__ import annotations


import numpy as np
import pytest

from hybridrec.core.wire import codec
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.wire.frames import EmbeddingArrays, Embeddings
from hybridrec.core.layouts.slot_layouts import CheckedEmbeddings
from tests.unit.test_frames import assert_mutations_decode_or_refuse, assert_truncations_refused, embeddings

VALUES = ValueCodec(fp16=True, kappa=1024.0)


def _sent(raw: bytes) -> codec.Frame:
    """An `Embeddings` frame as the receiver's codec decodes it (its positions and lengths compressed)."""
    return Embeddings.decode_frame(raw, 3, 5, ids_per_sample=3 * 8)


def _laid_out(emb: Embeddings, values: ValueCodec = VALUES) -> bytes:
    """What a receiver process makes of `emb` for its trainer, the third feature taken as a sequence."""
    sent = _sent(emb.encode(values))
    sequence = (np.arange(emb.batch_size * 2, dtype=np.int64).reshape(emb.batch_size, 2),
                emb.bags.lengths[2].astype(np.int64))
    checked = CheckedEmbeddings(EmbeddingArrays.of(sent), emb.batch_size, emb.bags.bounds,
                                np.array([0, 3, 0], np.int64), {2: sequence})
    buf = bytearray(1 << 16)
    return bytes(buf[:checked.encode_into(lambda n: memoryview(buf)[:n])])


def test_the_arrays_cross_as_they_came_with_what_pooling_derives():
    emb = embeddings()
    checked = CheckedEmbeddings.decode(_laid_out(emb), [2])
    as_sent = EmbeddingArrays.of(_sent(emb.encode(VALUES)))
    assert checked.batch_size == 5 and sorted(checked.arrays.rows) == sorted(checked.arrays.norms) == [4, 8]
    np.testing.assert_array_equal(checked.arrays.pos, as_sent.pos)
    np.testing.assert_array_equal(checked.arrays.lengths, as_sent.lengths)
    for dim in (4, 8):
        np.testing.assert_array_equal(checked.arrays.rows[dim], as_sent.rows[dim])
        np.testing.assert_array_equal(checked.arrays.norms[dim], as_sent.norms[dim])
    np.testing.assert_array_equal(checked.start, emb.bags.bounds)
    assert checked.base.tolist() == [0, 3, 0] and checked.sequences[2][0].shape == (5, 2)
    rows, pos, lengths = checked.bags([4, 8], VALUES.kappa)
    np.testing.assert_array_equal(pos, emb.bags.values)
    np.testing.assert_array_equal(lengths, emb.bags.lengths)
    assert rows[8].half.shape == (5, 8) and rows[4].norms.shape == (4,)


def test_float32_rows_cross_without_norms():
    emb = embeddings()
    checked = CheckedEmbeddings.decode(_laid_out(emb, ValueCodec(fp16=False)), [2])
    assert checked.arrays.norms == {}
    rows, _, _ = checked.bags([4, 8], 1.0)
    np.testing.assert_array_equal(rows[8], emb.rows[8])


def test_a_missing_array_is_named():
    checked = CheckedEmbeddings.decode(_laid_out(embeddings()), [2])
    with pytest.raises(ValueError, match="rows of width 16"):
        checked.bags([16], VALUES.kappa)
    with pytest.raises(ValueError, match="lack their sequence rows array"):
        CheckedEmbeddings.decode(_laid_out(embeddings()), [1])


def _decode(buf: bytes):
    return CheckedEmbeddings.decode(buf, [2]).bags([4, 8], VALUES.kappa)


def test_a_truncated_layout_is_refused():
    assert_truncations_refused(_laid_out(embeddings()), _decode)


def test_a_mutated_layout_decodes_or_raises_value_error():
    """The decoder returns views within the buffer or raises ValueError, nothing else."""
    assert_mutations_decode_or_refuse(_laid_out(embeddings()), _decode, seed=7)

