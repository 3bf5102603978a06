"""The two rules a catching-up PS backup follows (services/embedding_ps/replica.py): a row shipped after the copy
was taken wins over the copy's, and a missing shipment makes it copy again. The whole flow, with two real PS
processes, is tests/integration/test_ps_replicas.py."""
from __future__ import annotations

import numpy as np

from services.embedding_ps.replica import backup_host, backup_of, rows_to_keep, seq_after

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
