"""The embedding worker's buffer on file: a worker started on a dead one's directory serves its batches.

`BufferFiles` alone (write, re-attach, consume, refuse a foreign directory),
and `EmbeddingWorker` restarted on its directory against two real PS shards'
servicers (the `Cluster` of test_embedding_worker): the same batch_refs are
served, a push cut off midway is applied once per shard, and a request
re-sent for a batch consumed just before the restart is answered.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hybridrec.core.config import Config, FeatureConfig
from hybridrec.core.wire.frames import Gradients, make_batch_ref
from hybridrec.core.runtime.rpc import NotFound, Unavailable
from services.embedding_worker import buffer_files
from services.embedding_worker.buffer_files import RETIRED_KEPT, BufferFiles
from services.embedding_worker.worker import EmbeddingWorker, buffer_dir
from tests.unit.test_embedding_worker import FEATURES as FEATURE_SPECS
from tests.unit.test_embedding_worker import LR, REPLICA, Cluster, _batch

FEATURES = [FeatureConfig(name=n, group=g, dim=d) for n, g, d in FEATURE_SPECS]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def _restart(cluster: Cluster) -> EmbeddingWorker:
    """What the launcher does after kill -9: a new worker process on the same directory."""
    cluster.worker.close()
    cluster.worker = EmbeddingWorker(cluster.config, REPLICA, cluster.ps_call)
    return cluster.worker


def _gradients(worker: EmbeddingWorker, ref: int, seed: int = 0) -> Gradients:
    """Gradients of multiples of 1/64 (exact sums), decoded as the servicer would."""
    rng = np.random.default_rng(seed)
    grads = {d: (rng.integers(-64, 64, (n, d)) / 64).astype(np.float32) for d, n in worker.rows_of(ref).items()}
    return Gradients.decode(Gradients(ref, grads).encode(worker.values), worker.values, worker.rows_of)


# -- BufferFiles -------------------------------------------------------------------------------
def test_files_keep_frames_and_numbers_across_reopening(tmp_path):
    files = BufferFiles.open(tmp_path / "b", features=FEATURES, replica=2)
    incarnation, nonce = files.incarnation, files.nonce
    assert 0 <= incarnation < 1 << 16 and nonce >> 56 == 2 ^ 0xFF
    seqs = [files.reserve() for _ in range(3)]
    assert seqs == [0, 1, 2]
    files.write(0, b"first")
    files.write(2, b"third")  # 1 was reserved, never written: a put that died before its rename
    files.consumed(2, eval_batch=False)
    (tmp_path / "b" / f"{7:010x}.tmp").write_bytes(b"torn")
    files.close()

    again = BufferFiles.open(tmp_path / "b", features=FEATURES, replica=2)
    try:
        assert (again.incarnation, again.nonce) == (incarnation, nonce)
        assert [(b.seq, b.frame) for b in again.stored()] == [(0, b"first")]
        assert again.was_applied(2) and not again.was_applied(0)
        assert again.reserve() == 3  # never a number an earlier life handed out
        assert not list((tmp_path / "b").glob("*.tmp"))
    finally:
        again.close()


def test_consumed_batches_are_remembered_for_a_while(tmp_path):
    files = BufferFiles.open(tmp_path / "b", features=FEATURES, replica=0)
    try:
        for seq in range(RETIRED_KEPT + 10):
            files.write(files.reserve(), b"frame %d" % seq)
            files.consumed(seq, eval_batch=seq % 2 == 1)
        assert files.served_frame(RETIRED_KEPT + 9) == b"frame %d" % (RETIRED_KEPT + 9)
        assert files.was_applied(RETIRED_KEPT + 8) and not files.was_applied(RETIRED_KEPT + 9)
        assert not files.was_applied(0) and files.served_frame(1) is None  # forgotten
        assert len([p for p in (tmp_path / "b").iterdir() if p.suffix in (".applied", ".served")]) == RETIRED_KEPT
        assert files.nbytes() == sum(len(b"frame %d" % s) for s in range(11, RETIRED_KEPT + 10, 2))
    finally:
        files.close()


def test_a_directory_of_another_config_or_replica_is_refused(tmp_path):
    BufferFiles.open(tmp_path / "b", features=FEATURES, replica=1).close()
    with pytest.raises(ValueError, match=r"buffer .*/b was made with feature fingerprint .* another config"):
        BufferFiles.open(tmp_path / "b", features=FEATURES[:-1], replica=1)
    with pytest.raises(ValueError, match="replica 1, but this worker has replica 4"):
        BufferFiles.open(tmp_path / "b", features=FEATURES, replica=4)
    (tmp_path / "b" / "header.bin").write_bytes(b"\1" * 128)
    with pytest.raises(ValueError, match="bad magic"):
        BufferFiles.open(tmp_path / "b", features=FEATURES, replica=1)


def test_one_process_at_a_time(tmp_path):
    files = BufferFiles.open(tmp_path / "b", features=FEATURES, replica=0)
    try:
        with pytest.raises(RuntimeError, match="already open"):
            BufferFiles.open(tmp_path / "b", features=FEATURES, replica=0)
    finally:
        files.close()
    BufferFiles.open(tmp_path / "b", features=FEATURES, replica=0).close()  # released


def test_an_unsealed_buffer_is_recreated(tmp_path):
    files = BufferFiles.open(tmp_path / "b", features=FEATURES, replica=0)
    files.write(files.reserve(), b"x")
    files.close()
    header = np.fromfile(tmp_path / "b" / "header.bin", dtype=np.uint64)
    header[buffer_files.H_MAGIC] = 0  # creation died before sealing
    header.tofile(tmp_path / "b" / "header.bin")
    files = BufferFiles.open(tmp_path / "b", features=FEATURES, replica=0)
    try:
        assert list(files.stored()) == [] and files.reserve() == 0
    finally:
        files.close()


# -- EmbeddingWorker across a restart ----------------------------------------------------------
def test_the_worker_stores_the_bytes_it_was_sent(cluster):
    frame = _batch(seed=1).encode()
    ref = cluster.worker.put(frame)
    stored = list(buffer_dir(cluster.config, REPLICA).glob("*.batch"))
    assert len(stored) == 1 and stored[0].read_bytes() == frame
    assert int(stored[0].stem, 16) == ref & ((1 << 40) - 1)


def test_a_restarted_worker_serves_the_batches_of_its_previous_life(cluster):
    worker = cluster.worker
    refs = [worker.put(_batch(seed).encode()) for seed in range(3)]
    asyncio.run(worker.lookup(refs[0]))
    asyncio.run(worker.push_gradients(_gradients(worker, refs[0])))  # consumed
    before = asyncio.run(worker.lookup(refs[1]))

    worker = _restart(cluster)
    assert set(worker.buffer) == set(refs[1:])
    assert worker.stats()["batches_recovered_total"] == 2 == worker.recovery().batches_recovered  # metric, typed
    assert asyncio.run(worker.lookup(refs[1])) == before  # same plan, same rows
    asyncio.run(worker.push_gradients(_gradients(worker, refs[1])))
    assert refs[1] not in worker.buffer
    new = worker.put(_batch(seed=9).encode())
    assert new == make_batch_ref(REPLICA, worker.incarnation, 3)  # same incarnation, the next number

    worker = _restart(cluster)
    assert set(worker.buffer) == {refs[2], new}
    assert worker.stats()["batches_recovered_total"] == 4 == worker.recovery().batches_recovered  # every life


def test_a_push_cut_off_midway_is_applied_once_on_every_shard(cluster):
    worker = cluster.worker
    ref = worker.put(_batch(seed=3, batch_size=12).encode())
    asyncio.run(worker.lookup(ref))
    gradients = _gradients(worker, ref)
    ids = {d: worker.buffer[ref].uniq[d] for d in (4, 8)}
    before = {d: cluster.ps_rows(d, ids[d]) for d in ids}
    expected_step = {}
    for d in ids:  # what one SGD step moves each row by
        summed = np.zeros((ids[d].size, d), np.float32)
        np.add.at(summed, worker.buffer[ref].gidx[d], gradients.grads[d])
        expected_step[d] = -np.float32(LR) * summed

    real_call = cluster.ps_call

    async def shard_1_down(shard: int, method: str, frame: bytes) -> bytes:
        if shard == 1 and method == "Update":
            raise Unavailable("PS shard 1 Update failed: UNAVAILABLE")
        return await real_call(shard, method, frame)

    worker.ps_call = shard_1_down  # shard 0 applies its part, shard 1 never hears of it
    with pytest.raises(Unavailable):
        asyncio.run(worker.push_gradients(gradients))
    assert ref in worker.buffer  # not consumed: the NN worker's retry will push it again

    worker = _restart(cluster)  # and the worker dies before that retry
    applied = asyncio.run(worker.push_gradients(_gradients(worker, ref)))
    for d in ids:
        np.testing.assert_allclose(cluster.ps_rows(d, ids[d]), before[d] + expected_step[d], rtol=0, atol=1e-6)
    dedup = [s.stats()["updates_deduplicated_total"] for s in cluster.servicers]
    assert dedup == [1.0, 0.0]  # shard 0 recognised the re-send
    assert 0 < applied.applied < sum(a.size for a in ids.values())  # only shard 1's rows were applied now
    assert worker.already_applied(ref)


def test_requests_for_batches_consumed_just_before_a_restart_are_answered(cluster):
    worker = cluster.worker
    train = worker.put(_batch(seed=4).encode())
    evaluated = worker.put(_batch(seed=5, phase="eval").encode())
    asyncio.run(worker.lookup(train))
    asyncio.run(worker.push_gradients(_gradients(worker, train)))
    eval_frame = asyncio.run(worker.lookup(evaluated))

    worker = _restart(cluster)  # died after consuming both, before either answer got out
    assert worker.buffer == {}
    assert worker.already_applied(train)
    assert asyncio.run(worker.lookup(evaluated)) == eval_frame
    with pytest.raises(NotFound):
        asyncio.run(worker.lookup(train))
    with pytest.raises(NotFound):  # another incarnation's ref with the same number is not ours
        asyncio.run(worker.lookup(make_batch_ref(REPLICA, (worker.incarnation + 1) % (1 << 16), 1)))
    assert not worker.already_applied(make_batch_ref(REPLICA, (worker.incarnation + 1) % (1 << 16), 0))


def test_a_worker_of_another_feature_config_refuses_the_directory(cluster):
    cluster.worker.put(_batch().encode())
    cluster.worker.close()
    tree = cluster.config.model_dump(mode="json")
    tree["features"] = tree["features"][:-1]
    with pytest.raises(ValueError, match=str(buffer_dir(cluster.config, REPLICA))):
        EmbeddingWorker(Config.model_validate(tree), REPLICA, cluster.ps_call)
    cluster.worker = EmbeddingWorker(cluster.config, REPLICA, cluster.ps_call)  # for the fixture's close


def test_an_unreadable_stored_batch_is_dropped_not_fatal(cluster):
    good = cluster.worker.put(_batch(seed=1).encode())
    bad = cluster.worker.put(_batch(seed=2).encode())
    path = buffer_dir(cluster.config, REPLICA) / f"{bad & ((1 << 40) - 1):010x}.batch"
    path.write_bytes(path.read_bytes()[:40])
    worker = _restart(cluster)
    assert set(worker.buffer) == {good} and not path.exists()
    with pytest.raises(NotFound):
        asyncio.run(worker.lookup(bad))
