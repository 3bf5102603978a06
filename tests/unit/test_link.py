"""What crosses the link between an NN worker's trainer and its receiver in a message (services/nn_worker/link.py):
a dense batch's fields and arrays, a PutBatch's answer."""
from __future__ import annotations

import numpy as np
import pytest

from hybridrec.frames import Consumed, DenseBatch
from services.nn_worker.link import batch_of, lay_out_batch, pack_consumed, unpack_consumed


def _round_trip(batch: DenseBatch) -> DenseBatch:
    slot = bytearray(1 << 20)
    fields, nbytes = lay_out_batch(batch, lambda n: memoryview(slot)[:n])
    got = batch_of(fields, memoryview(slot)[:nbytes])
    slot[:] = bytes(len(slot))  # the receiver reuses its slot once answered: the batch must not see it
    return got


@pytest.mark.parametrize("tasks", [1, 3])
def test_a_dense_batch_crosses_whole(tasks):
    rng = np.random.default_rng(tasks)
    rows = 1000
    batch = DenseBatch(batch_ref=(1 << 64) - 3, dense=rng.standard_normal((rows, 13), dtype=np.float32),
                       labels=rng.random((rows, tasks) if tasks > 1 else rows, dtype=np.float32), phase="eval",
                       seq=-1 if tasks == 1 else 41, position=(3, 0, (1 << 64) - 1, 17)[:tasks + 1],
                       rows_before=123456789, loader=2)
    expected = DenseBatch(batch.batch_ref, batch.dense.copy(), batch.labels.copy(), batch.phase, batch.seq,
                          batch.position, batch.rows_before, batch.loader)
    got = _round_trip(batch)
    assert (got.batch_ref, got.phase, got.seq, got.position, got.rows_before, got.loader) == (
        expected.batch_ref, expected.phase, expected.seq, expected.position, expected.rows_before, expected.loader)
    np.testing.assert_array_equal(got.dense, expected.dense)
    np.testing.assert_array_equal(got.labels, expected.labels)
    assert got.labels.shape == expected.labels.shape


def test_a_position_beyond_64_bits_is_refused():
    batch = DenseBatch(1, np.zeros((1, 1), np.float32), np.zeros(1, np.float32), position=(1 << 64,))
    with pytest.raises(ValueError, match="64 bits"):
        lay_out_batch(batch, lambda n: memoryview(bytearray(n)))


def test_a_putbatch_answer_crosses_whole():
    for consumed in (Consumed("train", -1, 1), Consumed("eval", 7, (1 << 62) | 1)):
        assert unpack_consumed(pack_consumed(consumed)) == consumed
