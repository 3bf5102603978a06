"""The rules a catching-up PS backup follows (services/embedding_ps/replica.py): a row shipped after the copy
was taken wins over the copy's, a missing shipment makes it copy again, and two readers of a shard at once
each read their own copy. The whole flow, with two real PS processes, is tests/integration/test_ps_replicas.py."""
from __future__ import annotations

import numpy as np
import pytest

from hybridrec.core.runtime.rpc import FailedPrecondition
from hybridrec.core.wire.frames import ShardPull
from services.embedding_ps.replica import Copy, OpenCopies, backup_host, backup_of, rows_to_keep, seq_after

LIFE, OTHER = 7, 9


def _keys(*ids: int) -> np.ndarray:
    return np.array(ids, np.uint64)


def test_rows_shipped_after_the_copy_was_taken_are_not_overwritten_by_it():
    received = [(LIFE, 10, {8: _keys(1, 2)}),  # before the copy (seq 11): the copy has them, newer
                (LIFE, 12, {8: _keys(3)}, ),  # after it: newer than the copy's
                (LIFE, 13, {4: _keys(4)}),  # after it, another width
                (OTHER, 14, {8: _keys(5)})]  # another life of the primary: not this copy's history
    keep = rows_to_keep(_keys(1, 2, 3, 4, 5, 6), 8, received, life=LIFE, seq=11)
    assert keep.tolist() == [True, True, False, True, True, True]
    assert rows_to_keep(_keys(4, 6), 4, received, life=LIFE, seq=11).tolist() == [False, True]
    assert rows_to_keep(_keys(1), 8, [], life=LIFE, seq=0).tolist() == [True]


def test_a_backup_is_in_sync_only_when_no_shipment_after_the_copy_is_missing():
    assert seq_after([], life=LIFE, seq=5) == 5
    assert seq_after([(LIFE, 4, {}), (LIFE, 6, {}), (LIFE, 7, {})], life=LIFE, seq=5) == 7
    assert seq_after([(LIFE, 7, {}), (LIFE, 6, {})], life=LIFE, seq=5) == 7  # arrival order does not matter
    assert seq_after([(LIFE, 6, {}), (LIFE, 8, {})], life=LIFE, seq=5) is None  # 7 went missing
    assert seq_after([(OTHER, 6, {})], life=LIFE, seq=5) == 5
    # The primary's heartbeat after a failed shipment: where it is. Received with every shipment up to it, the
    # copy is complete; alone past the copy, shipments went missing and the backup copies again.
    assert seq_after([(LIFE, 6, {}), (LIFE, 7, {}), (LIFE, 7, {})], life=LIFE, seq=5) == 7
    assert seq_after([(LIFE, 8, {})], life=LIFE, seq=5) is None


def test_each_shard_is_backed_up_on_the_next_ps():
    assert [backup_host(s, 3) for s in range(3)] == [1, 2, 0]
    assert [backup_of(p, 3) for p in range(3)] == [2, 0, 1]
    assert all(backup_of(backup_host(s, 4), 4) == s for s in range(4))


def _copy_of(seq: int, pages: int) -> Copy:
    keys = [np.arange(i * 10 + 1, i * 10 + 4, dtype=np.uint64) for i in range(pages)]
    return Copy(0, 1, seq, [(8, k, np.full((3, 16), seq, np.float32)) for k in keys], np.arange(3, dtype=np.uint64))


def test_two_readers_at_once_each_read_their_own_copy_to_its_end():
    """A backup catching up and an operator's dump of the same shard, interleaved page by page: the second's
    page 0 leaves the first's copy alone, and each reader's pages are of its own copy."""
    copies = OpenCopies("shard 0")
    first, second = _copy_of(seq=5, pages=3), _copy_of(seq=9, pages=2)
    copies.open(first)
    a0 = copies.page(ShardPull(0, "primary", 0), first.id)
    copies.open(second)
    b0 = copies.page(ShardPull(0, "primary", 0), second.id)
    assert a0.copy_id == first.id != b0.copy_id == second.id
    read = {a0.copy_id: [a0], b0.copy_id: [b0]}
    for i in (1, 2):
        for reader in (a0, b0):
            if i < reader.pages:
                read[reader.copy_id].append(copies.page(ShardPull(0, "primary", i, copy_id=reader.copy_id),
                                                        reader.copy_id))
    for reader, seq in ((a0, 5), (b0, 9)):
        pages = read[reader.copy_id]
        assert [p.page for p in pages] == list(range(reader.pages))
        assert all(p.seq == seq and (p.rows[8][1] == seq).all() for p in pages)
        assert pages[-1].uids is not None
    with pytest.raises(FailedPrecondition, match="read to its end"):  # each went once read to its end
        copies.page(ShardPull(0, "primary", 1, copy_id=first.id), first.id)


def test_open_copies_are_bounded_and_the_oldest_reader_is_told_to_start_over():
    copies = OpenCopies("shard 0")
    opened = [_copy_of(seq, pages=2) for seq in range(OpenCopies.KEEP + 1)]
    for copy in opened:
        copies.open(copy)
    with pytest.raises(FailedPrecondition, match="ask for page 0 first"):
        copies.page(ShardPull(0, "primary", 1, copy_id=opened[0].id), opened[0].id)
    assert copies.page(ShardPull(0, "primary", 1, copy_id=opened[-1].id), opened[-1].id).seq == OpenCopies.KEEP
