"""Batching across chunks and dealing equal batch counts to NN ranks."""
import numpy as np

from hybridrec.core.wire import codec
from hybridrec.core.wire.frames import DenseBatch, SparseBatch, decode_nn_batch
from services.dataloader.batching import Position, ReadCounters, Rows, deal_evenly, iter_batches, iter_train_batches


def _rows(n, start=0):
    labels = np.arange(start, start + n, dtype=np.float32)
    ids = np.stack([np.arange(start, start + n), np.arange(start, start + n) + 1000], axis=1).astype(np.uint64)
    return Rows.from_columns(labels, np.zeros((n, 13), np.float32), ids, np.ones((n, 2), bool))


def test_batches_cross_chunk_boundaries_in_order():
    chunks = [_rows(5, 0), _rows(7, 5), _rows(3, 12)]
    batches = list(iter_batches(chunks, 4))
    assert [len(b) for b in batches] == [4, 4, 4, 3]
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), np.arange(15))
    # the IDs travel with their samples across the chunk boundaries
    np.testing.assert_array_equal(np.concatenate([b.bags.bag(1).values for b in batches]), np.arange(15) + 1000)


def _positioned(batches):
    return [(b, Position(0, 0, i, i + 1)) for i, b in enumerate(batches)]


def test_every_rank_gets_the_same_number_of_batches():
    counters = ReadCounters()
    items = list(deal_evenly(_positioned(iter_batches([_rows(23)], 4)), 2, counters))
    ranks = [r for r, _, _ in items]
    assert ranks.count(0) == ranks.count(1) == 3
    assert sum(len(b) for _, b, _ in items) == 23 and counters.dropped_rows == 0
    assert items[-1][2] == Position(0, 0, 5, 6)  # the split tail carries the position after its last batch
    items = list(deal_evenly(_positioned(iter_batches([_rows(1)], 4)), 2, counters))
    assert items == [] and counters.dropped_rows == 1


def test_train_batches_resume_exactly_after_a_position(small_data):
    columns, groups = np.arange(26), list(range(26))
    kwargs = dict(epochs=2, batch_size=1000, columns=columns, groups=groups, bad_lines="skip")
    paths = [str(small_data / "train.tsv")]
    full = list(iter_train_batches(paths, counters=ReadCounters(), **kwargs))
    assert len(full) == 2 * 60 and all(len(b) == 1000 for b, _ in full)
    cut = 37
    resumed = list(iter_train_batches(paths, counters=ReadCounters(), start=full[cut - 1][1], **kwargs))
    assert len(resumed) == len(full) - cut
    for (a, pa), (b, pb) in zip(full[cut:], resumed):
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.bags.values, b.bags.values)
        np.testing.assert_array_equal(a.bags.lengths, b.bags.lengths)
        assert pa == pb


def test_sparse_batch_round_trip_and_validation():
    ids = np.array([[1, 5], [2, 5], [1, 7]], dtype=np.uint64)
    present = np.array([[True, True], [True, False], [True, True]])
    sb = SparseBatch.from_columns(ids, present, phase="train")
    back = SparseBatch.decode(sb.encode(), 2)
    for f in range(2):
        np.testing.assert_array_equal(back.ids(f).values, ids[present[:, f], f])
        np.testing.assert_array_equal(back.bags.lengths[f], present[:, f])
    tensors = codec.decode(sb.encode(lz4=False)).tensors
    tensors = {k: np.array(v) for k, v in tensors.items()}
    tensors["p0"][0] = 9  # points outside the unique IDs
    bad = codec.encode(tensors, {"batch_size": 3, "phase": "train"})
    try:
        SparseBatch.decode(bad, 2)
    except codec.FrameError as exc:
        assert "position" in str(exc)
    else:
        raise AssertionError("a position outside the unique IDs was accepted")


def test_dense_batch_round_trip():
    db = DenseBatch(7, np.ones((3, 13), np.float32), np.zeros(3, np.float32), "eval")
    back = decode_nn_batch(db.encode(), 13)
    assert back.batch_ref == 7 and back.phase == "eval" and back.dense.shape == (3, 13)
