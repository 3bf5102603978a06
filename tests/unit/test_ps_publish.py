"""EmbeddingPS.Publish in-process: a delta holds exactly the rows changed since the last publish, deltas merged
onto the first full snapshot equal a full snapshot taken at the same moment, a delta on a version the shard did
not publish last is refused, and `peek` neither admits nor refreshes."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from hybridrec.core.layouts.bundle import BundleManifest, FileEntry, file_entry
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import EmbeddingOptimizerConfig, FeatureConfig, ModelConfig, PSConfig
from hybridrec.core.layouts.files import write_json_atomic
from hybridrec.core.wire.frames import PSLookup, PSUpdate
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime.rpc import FailedPrecondition
from hybridrec.core.layouts.versions import Follower, table_arrays, version_dir
from services.embedding_ps.applied import AppliedLog
from services.embedding_ps.publish import ChangeLog
from services.embedding_ps.server import EmbeddingPSServicer
from services.embedding_ps.store import EmbeddingStore, StoreConfig

WIDTHS = (4, 8)
FEATURES = [FeatureConfig(name="a", group=0, dim=4), FeatureConfig(name="b", group=1, dim=8)]
VALUES = ValueCodec(fp16=False, kappa=1.0)


@pytest.fixture
def ps(tmp_path):
    stores = {d: EmbeddingStore.open(tmp_path / "shm" / f"dim-{d}",
                                     StoreConfig(dim=d, optimizer=EmbeddingOptimizerConfig(name="adagrad", lr=0.1),
                                                 ps=PSConfig(capacity=50_000, num_stripes=4))) for d in WIDTHS}
    executor = ThreadPoolExecutor(2)
    applied = AppliedLog.open(tmp_path / "shm" / "applied")
    servicer = EmbeddingPSServicer(stores, applied, 0, 1, VALUES, executor, publish_root=str(tmp_path / "versions"))
    yield servicer
    executor.shutdown()
    for store in stores.values():
        store.close()
    applied.close()


def train_batch(servicer, rng, key_space):
    """What one training batch does to a shard: a train lookup (admits) and an update of the same IDs."""
    ids = {d: np.unique(rng.integers(1, key_space, size=300).astype(np.uint64)) for d in WIDTHS}
    asyncio.run(servicer.Lookup(PSLookup(ids, train=True).encode(), None))
    grads = {d: rng.standard_normal((ids[d].size, d)).astype(np.float32) for d in WIDTHS}
    update_id = int(rng.integers(1, 1 << 63))
    asyncio.run(servicer.Update(PSUpdate(ids, grads, update_id).encode(VALUES), None))
    return ids


def finish_version(servicer, root, version, reply, base):
    """Rank 0's part: dense.pt, then the manifest."""
    path = version_dir(root, version)
    files = {f.path: FileEntry(bytes=f.bytes, sha256=f.sha256) for f in reply.files}
    torch.save({"w": torch.zeros(1)}, path / "dense.pt")
    files["dense.pt"] = file_entry(path / "dense.pt")
    write_json_atomic(path / "manifest.json", BundleManifest(
        version=version, base_version=base, features=FEATURES, num_dense=1, model=ModelConfig(), num_shards=1,
        rows=dict(reply.rows_by_dim), files=files).model_dump(mode="json"))


def publish(servicer, version, full, base=0):
    return asyncio.run(servicer.Publish(pb.PublishRequest(version=version, full=full, base_version=base), None))


def test_deltas_hold_the_changed_rows_and_merge_to_the_full_snapshot(ps, tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "versions"
    for _ in range(5):
        train_batch(ps, rng, 20_000)
    reply = publish(ps, 1, full=True)
    assert reply.rows == sum(int(s.stats()["rows"]) for s in ps.stores.values())
    finish_version(ps, root, 1, reply, None)
    for version in range(2, 5):
        changed = [train_batch(ps, rng, 20_000) for _ in range(3)]
        reply = publish(ps, version, full=False, base=version - 1)
        for d in WIDTHS:  # exactly the IDs touched since the last publish
            want = np.unique(np.concatenate([c[d] for c in changed]))
            keys = np.load(version_dir(root, version) / f"embeddings/shard-00000-of-00001/dim{d}.keys.npy")
            assert keys.tolist() == want.tolist() and reply.rows_by_dim[d] == want.size
        finish_version(ps, root, version, reply, version - 1)
    merged = Follower(root).poll()
    assert merged.version == 4
    reply = publish(ps, 5, full=True)  # the same state, in full (nothing trained in between)
    full_root = tmp_path / "full"  # moved aside and labelled version 4, to compare with the merged 4
    full_root.mkdir()
    version_dir(root, 5).rename(version_dir(full_root, 4))
    finish_version(ps, full_root, 4, reply, None)
    full = Follower(full_root).poll()
    for d in WIDTHS:
        for a, b in zip(table_arrays(merged.table, d), table_arrays(full.table, d)):
            np.testing.assert_array_equal(a, b)
        keys, rows = table_arrays(full.table, d)
        np.testing.assert_array_equal(rows, ps.stores[d].lookup(keys, train=False))


def test_a_delta_on_a_version_this_shard_did_not_publish_is_refused(ps):
    rng = np.random.default_rng(1)
    train_batch(ps, rng, 1000)
    with pytest.raises(FailedPrecondition, match="last published nothing"):
        publish(ps, 1, full=False, base=0)
    publish(ps, 1, full=True)
    with pytest.raises(FailedPrecondition, match="last published 1"):
        publish(ps, 3, full=False, base=2)
    assert publish(ps, 2, full=False, base=1).rows == 0  # nothing changed since 1
    with pytest.raises(ValueError, match="version 0"):
        publish(ps, 0, full=True)


def test_publishing_is_off_without_a_directory(tmp_path):
    store = EmbeddingStore.open(tmp_path / "s", StoreConfig(dim=4, optimizer=EmbeddingOptimizerConfig(name="sgd"),
                                                            ps=PSConfig(capacity=64, num_stripes=2)))
    applied = AppliedLog.open(tmp_path / "applied")
    try:
        servicer = EmbeddingPSServicer({4: store}, applied, 0, 1, VALUES, ThreadPoolExecutor(1))
        assert servicer.changes is None
        with pytest.raises(ValueError, match="publish.dir"):
            publish(servicer, 1, full=True)
    finally:
        store.close()
        applied.close()


def test_peek_neither_admits_nor_refreshes(ps):
    store = ps.stores[4]
    ids = np.arange(1, 9, dtype=np.uint64)
    rows = store.lookup(ids[:4], train=True)
    before, order = store.stats(), store.items()[0]
    got, found = store.peek(ids)
    assert found.tolist() == [True] * 4 + [False] * 4
    np.testing.assert_array_equal(got[:4], rows)
    assert not got[4:].any()
    after = store.stats()
    assert after["rows"] == before["rows"] and after["read_misses"] == before["read_misses"]
    assert store.items()[0].tolist() == order.tolist()  # recency order unchanged


def test_change_log_dedups_and_starts_empty_after_take(monkeypatch):
    monkeypatch.setattr("services.embedding_ps.publish.COMPACT_AT", 4)
    log = ChangeLog([4])
    log.add(4, np.array([5, 1, 5], np.uint64))
    log.add(4, np.array([3, 1], np.uint64))
    assert log.pending() == 3  # deduplicated in place once past the limit
    for i in range(10):
        log.add(4, np.array([i, i + 100], np.uint64))
    assert log.pending() <= 2 * 23 + 2
    assert log.take()[4].tolist() == sorted({1, 3, 5} | set(range(10)) | set(range(100, 110)))
    assert log.take()[4].tolist() == [] and log.pending() == 0
