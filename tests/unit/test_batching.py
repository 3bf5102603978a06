"""Batching across chunks and dealing equal batch counts to NN ranks."""
import numpy as np

from hybridrec import codec
from hybridrec.batch import DenseBatch, SparseBatch
from services.dataloader.batching import ReadCounters, Rows, deal_evenly, iter_batches


def _rows(n, start=0):
    labels = np.arange(start, start + n, dtype=np.float32)
    return Rows(labels, np.zeros((n, 13), np.float32), np.zeros((n, 2), np.uint64), np.ones((n, 2), bool))


def test_batches_cross_chunk_boundaries_in_order():
    chunks = [_rows(5, 0), _rows(7, 5), _rows(3, 12)]
    batches = list(iter_batches(chunks, 4))
    assert [len(b) for b in batches] == [4, 4, 4, 3]
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), np.arange(15))


def test_every_rank_gets_the_same_number_of_batches():
    counters = ReadCounters()
    pairs = list(deal_evenly(iter_batches([_rows(23)], 4), 2, counters))
    ranks = [r for r, _ in pairs]
    assert ranks.count(0) == ranks.count(1) == 3
    assert sum(len(b) for _, b in pairs) == 23 and counters.dropped_rows == 0
    pairs = list(deal_evenly(iter_batches([_rows(1)], 4), 2, counters))
    assert pairs == [] and counters.dropped_rows == 1


def test_sparse_batch_round_trip_and_validation():
    ids = np.array([[1, 5], [2, 5], [1, 7]], dtype=np.uint64)
    present = np.array([[True, True], [True, False], [True, True]])
    sb = SparseBatch.from_columns(ids, present, phase="train")
    back = SparseBatch.decode(codec.decode(sb.encode()), 2)
    for f in range(2):
        np.testing.assert_array_equal(back.uniq[f][back.pos[f]], ids[present[:, f], f])
        np.testing.assert_array_equal(back.lengths[f], present[:, f])
    tensors = codec.decode(sb.encode(lz4=False)).tensors
    tensors = {k: np.array(v) for k, v in tensors.items()}
    tensors["p0"][0] = 9  # points outside the unique IDs
    bad = codec.decode(codec.encode(tensors, {"batch_size": 3, "phase": "train"}))
    try:
        SparseBatch.decode(bad, 2)
    except codec.FrameError as exc:
        assert "position" in str(exc)
    else:
        raise AssertionError("a position outside the unique IDs was accepted")


def test_dense_batch_round_trip():
    db = DenseBatch(7, np.ones((3, 13), np.float32), np.zeros(3, np.float32), "eval")
    back = DenseBatch.decode(codec.decode(db.encode()), 13)
    assert back.batch_ref == 7 and back.phase == "eval" and back.dense.shape == (3, 13)
