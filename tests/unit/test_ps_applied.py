"""A PS shard applies each update id at most once, across re-sends and re-opening its files.

`AppliedLog` alone (record, window, re-attach, torn records, refusal of a
foreign file), and `EmbeddingPSServicer.Update` with a real store: a re-sent
update is acknowledged with 0 rows and counted, including after the store
and the record are closed and re-opened, when the re-send races its
original, and when the original's request was cancelled midway.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig
from hybridrec.core.wire.frames import Applied, PSLookup, PSRows, PSUpdate
from services.embedding_ps import applied as A
from services.embedding_ps.applied import WINDOW, AppliedLog
from services.embedding_ps.server import EmbeddingPSServicer
from services.embedding_ps.store import EmbeddingStore, StoreConfig

DIM, LR = 4, 0.5
VALUES = ValueCodec(fp16=False)
IDS = np.arange(1, 41, dtype=np.uint64)
GRADS = np.ones((IDS.size, DIM), np.float32)


# -- AppliedLog --------------------------------------------------------------------------------
def test_recorded_ids_survive_reopening(tmp_path):
    log = AppliedLog.open(tmp_path / "applied")
    for uid in (5, 9, 1 << 63):
        log.record(uid)
    log.count_duplicate()
    assert 9 in log and 7 not in log
    log.close()
    log = AppliedLog.open(tmp_path / "applied")
    try:
        assert all(uid in log for uid in (5, 9, 1 << 63)) and 7 not in log
        assert log.deduplicated == 1
    finally:
        log.close()


def test_the_window_keeps_the_most_recent_ids(tmp_path):
    log = AppliedLog.open(tmp_path / "applied")
    try:
        for uid in range(1, WINDOW + 11):
            log.record(uid)
        assert all(uid not in log for uid in range(1, 11))
        assert all(uid in log for uid in (11, WINDOW // 2, WINDOW + 10))
    finally:
        log.close()
    log = AppliedLog.open(tmp_path / "applied")  # the rebuilt index agrees
    try:
        assert 10 not in log and 11 in log and WINDOW + 10 in log
    finally:
        log.close()


def test_a_torn_record_loses_only_its_own_id(tmp_path):
    """A crash after reserving a slot, before writing the id: the slot's old id is still known."""
    log = AppliedLog.open(tmp_path / "applied")
    for uid in range(1, WINDOW + 1):
        log.record(uid)
    log._header[A.H_WRITTEN] += np.uint64(1)  # what record(WINDOW + 1) does first, then "dies"
    log.close()
    log = AppliedLog.open(tmp_path / "applied")
    try:
        assert 1 in log and WINDOW + 1 not in log
        log.record(WINDOW + 2)  # goes to the next slot, over id 2
        assert 1 in log and 2 not in log
    finally:
        log.close()


def test_a_foreign_or_other_window_file_is_refused(tmp_path):
    AppliedLog.open(tmp_path / "applied").close()
    ring = tmp_path / "applied" / "ring.bin"
    words = np.fromfile(ring, dtype=np.uint64)
    words[A.H_WINDOW] = WINDOW // 2
    words.tofile(ring)
    with pytest.raises(ValueError, match=f"window {WINDOW // 2}, this PS uses {WINDOW}"):
        AppliedLog.open(tmp_path / "applied")
    words[A.H_MAGIC] = 12345
    words.tofile(ring)
    with pytest.raises(ValueError, match="bad magic"):
        AppliedLog.open(tmp_path / "applied")
    words[A.H_MAGIC] = 0  # creation interrupted: recreated empty
    words.tofile(ring)
    AppliedLog.open(tmp_path / "applied").close()


def test_one_process_at_a_time(tmp_path):
    log = AppliedLog.open(tmp_path / "applied")
    try:
        with pytest.raises(RuntimeError, match="already open"):
            AppliedLog.open(tmp_path / "applied")
    finally:
        log.close()


# -- the PS servicer ---------------------------------------------------------------------------
class Shard:
    """One PS shard's store and record, opened (and re-opened) on tmp_path, behind its servicer."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.executor = ThreadPoolExecutor(2)
        self.open()

    def open(self) -> None:
        config = StoreConfig(dim=DIM, optimizer=EmbeddingOptimizerConfig(name="sgd", lr=LR),
                             ps=PSConfig(capacity=1024, num_stripes=2))
        self.store = EmbeddingStore.open(self.tmp_path / "dim-4", config)
        self.applied = AppliedLog.open(self.tmp_path / "applied")
        self.servicer = EmbeddingPSServicer({DIM: self.store}, self.applied, 0, 1, VALUES, self.executor)

    def close(self) -> None:
        self.store.close()
        self.applied.close()

    def rows(self) -> np.ndarray:
        reply = asyncio.run(self.servicer.Lookup(PSLookup({DIM: IDS}, train=False).encode(), None))
        return PSRows.decode(reply, VALUES, {DIM: IDS.size}).rows[DIM]


@pytest.fixture
def shard(tmp_path):
    s = Shard(tmp_path)
    asyncio.run(s.servicer.Lookup(PSLookup({DIM: IDS}, train=True).encode(), None))  # admit the rows
    yield s
    s.close()
    s.executor.shutdown()


def _update(uid: int) -> bytes:
    return PSUpdate({DIM: IDS}, {DIM: GRADS}, uid).encode(VALUES)


def test_a_re_sent_update_is_applied_once(shard):
    start = shard.rows()
    first = Applied.decode(asyncio.run(shard.servicer.Update(_update(77), None))).applied
    again = Applied.decode(asyncio.run(shard.servicer.Update(_update(77), None))).applied
    assert (first, again) == (IDS.size, 0)
    np.testing.assert_allclose(shard.rows(), start - LR, rtol=0, atol=1e-6)  # one step, not two
    assert shard.servicer.stats()["updates_deduplicated_total"] == 1
    assert Applied.decode(asyncio.run(shard.servicer.Update(_update(78), None))).applied == IDS.size  # another id


def test_a_re_send_after_re_opening_is_still_recognised(shard):
    start = shard.rows()
    asyncio.run(shard.servicer.Update(_update(77), None))
    shard.close()  # what a restarted PS process does: re-attach to the same files
    shard.open()
    assert Applied.decode(asyncio.run(shard.servicer.Update(_update(77), None))).applied == 0
    np.testing.assert_allclose(shard.rows(), start - LR, rtol=0, atol=1e-6)
    assert shard.servicer.stats()["updates_deduplicated_total"] == 1  # kept across lives


def test_a_re_send_racing_its_original_waits_for_it(shard):
    start = shard.rows()

    async def both():
        return await asyncio.gather(shard.servicer.Update(_update(5), None), shard.servicer.Update(_update(5), None))

    replies = sorted(Applied.decode(r).applied for r in asyncio.run(both()))
    assert replies == [0, IDS.size]
    np.testing.assert_allclose(shard.rows(), start - LR, rtol=0, atol=1e-6)


def test_an_update_whose_request_is_cancelled_still_records_its_id(shard):
    """The sender died mid-call: gRPC cancels the handler, but the rows and the record both happen."""
    start = shard.rows()

    async def cancelled_then_re_sent():
        original = asyncio.ensure_future(shard.servicer.Update(_update(9), None))
        await asyncio.sleep(0)  # the handler has started the update
        original.cancel()
        with pytest.raises(asyncio.CancelledError):
            await original
        return await shard.servicer.Update(_update(9), None)

    assert Applied.decode(asyncio.run(cancelled_then_re_sent())).applied == 0
    np.testing.assert_allclose(shard.rows(), start - LR, rtol=0, atol=1e-6)


def test_an_update_with_ids_of_another_shard_changes_nothing(tmp_path):
    s = Shard(tmp_path)
    try:
        s.servicer.num_shards = 2  # now half of IDS belong to the other shard
        with pytest.raises(ValueError, match="another shard"):
            asyncio.run(s.servicer.Update(_update(3), None))
        assert 3 not in s.applied
    finally:
        s.close()
        s.executor.shutdown()


def test_recent_ids_come_oldest_first_and_a_replica_inherits_them_without_counting_them(tmp_path):
    """What a shard restored from its backup must know: the ids the backup remembers, so their re-sends are
    still applied once; `applied` counts the new life's own updates only (services/embedding_ps/replica.py)."""
    log = AppliedLog.open(tmp_path / "a")
    for uid in range(1, 6):
        log.record(uid)
    assert log.recent().tolist() == [1, 2, 3, 4, 5] and log.applied == 5
    heir = AppliedLog.open(tmp_path / "b")
    heir.inherit(log.recent())
    heir.inherit(np.array([4, 5], np.uint64))  # inherited twice: remembered once
    heir.record(6)
    assert all(uid in heir for uid in range(1, 7)) and heir.applied == 1
    assert heir.recent().tolist() == [1, 2, 3, 4, 5, 6]
    heir.close()
    heir = AppliedLog.open(tmp_path / "b")  # the count of inherited ids is on file too
    assert heir.applied == 1 and 3 in heir
    heir.close()
    log.close()


def test_recent_ids_of_a_full_window_wrap_in_order(tmp_path):
    log = AppliedLog.open(tmp_path / "a")
    for uid in range(1, WINDOW + 11):
        log.record(uid)
    recent = log.recent()
    assert recent.shape == (WINDOW,) and recent[0] == 11 and recent[-1] == WINDOW + 10
    assert np.all(np.diff(recent.astype(np.int64)) == 1)
    log.close()


def test_empty_updates_under_fresh_ids_do_not_roll_the_window_past_a_real_one(shard):
    """An update without rows changes nothing and is not recorded: on 3b8ae06 a data-plane caller could send
    enough of them under fresh ids to push a real update out of the window, whose re-send was then applied
    twice."""
    from services.embedding_ps.applied import WINDOW

    start = shard.rows()
    assert Applied.decode(asyncio.run(shard.servicer.Update(_update(5), None))).applied == IDS.size
    empty = np.zeros(0, np.uint64)

    async def flood() -> None:
        for uid in range(1_000_000, 1_000_000 + WINDOW + 10):
            await shard.servicer.Update(PSUpdate({DIM: empty}, {DIM: np.zeros((0, DIM), np.float32)}, uid)
                                        .encode(VALUES), None)

    asyncio.run(flood())
    assert Applied.decode(asyncio.run(shard.servicer.Update(_update(5), None))).applied == 0  # still known
    np.testing.assert_allclose(shard.rows(), start - LR, rtol=0, atol=1e-6)
