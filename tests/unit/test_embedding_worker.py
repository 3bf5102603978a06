"""EmbeddingWorker (put, lookup, push_gradients) against two real PS shards' servicers, called in-process.

No gRPC: the worker's `ps_call` awaits the servicer's method directly, and every
call is recorded so the tests can check what each shard was sent.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import Config
from hybridrec.core.wire.frames import Embeddings, Gradients, PSLookup, PSUpdate, SparseBatch, worker_of_ref
from hybridrec.core.wire.ids import GROUP_SHIFT
from hybridrec.core.wire.jagged import KeyedBags
from hybridrec.core.runtime.rpc import NotFound
from hybridrec.core.wire.sharding import shard_of
from services.embedding_ps.server import EmbeddingPSServicer, open_applied, open_stores
from services.embedding_worker.worker import EmbeddingWorker

LR = 0.1
NUM_SHARDS = 2
REPLICA = 3
# name, group, dim: "a" and "b" share group 1 (so the same IDs, hence the same rows); two widths.
FEATURES = [("a", 1, 8), ("b", 1, 8), ("c", 2, 4), ("d", 3, 8)]
WIDTHS = [dim for _, _, dim in FEATURES]
MAX_LEN = 4  # a sample's bag of a feature: up to 3 drawn IDs, and one added


def _gid(group: int, value: int) -> int:
    return (group << GROUP_SHIFT) | value


class Cluster:
    """Two PS shards (real stores and servicers) and one embedding worker wired to them."""

    def __init__(self, tmp_path):
        self.config = Config.model_validate({
            "data": {"train": ["unused"], "format": "parquet"},  # multi-hot bags: list features
            "features": [{"name": n, "group": g, "dim": d, "kind": "list", "max_len": MAX_LEN} for n, g, d in FEATURES],
            "cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2"]},  # never dialled
            "ps": {"shm_dir": str(tmp_path / "shm"), "capacity": 4096, "num_stripes": 2},
            "optimizer": {"embedding": {"name": "sgd", "lr": LR}},
            "training": {"compression": {"fp16": False}},
        })
        self.values = ValueCodec(fp16=False)
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.stores = [open_stores(self.config, s) for s in range(NUM_SHARDS)]
        self.applied = [open_applied(self.config, s) for s in range(NUM_SHARDS)]
        self.servicers = [EmbeddingPSServicer(stores, self.applied[s], s, NUM_SHARDS, self.values, self.executor)
                          for s, stores in enumerate(self.stores)]
        self.calls: list[tuple[int, str, bytes]] = []
        self.worker = EmbeddingWorker(self.config, REPLICA, self.ps_call)

    async def ps_call(self, shard: int, method: str, frame: bytes) -> bytes:
        self.calls.append((shard, method, frame))
        return await getattr(self.servicers[shard], method)(frame, None)

    def ps_rows(self, dim: int, ids) -> np.ndarray:
        """Rows of `ids` read straight from the owning shard's store (read-only lookup)."""
        ids = np.asarray(ids, np.uint64)
        out = np.zeros((ids.size, dim), np.float32)
        owner = shard_of(ids, NUM_SHARDS)
        for s in range(NUM_SHARDS):
            mask = owner == s
            if mask.any():
                out[mask] = self.stores[s][dim].lookup(ids[mask], train=False)
        return out

    def close(self) -> None:
        self.worker.close()
        self.executor.shutdown(wait=True)
        for stores in self.stores:
            for store in stores.values():
                store.close()
        for applied in self.applied:
            applied.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def _sparse(bags_per_feature: list[list[list[int]]], phase: str = "train") -> SparseBatch:
    """A SparseBatch from explicit bags: bags_per_feature[f][i] is the list of IDs of feature f, sample i."""
    batch_size = len(bags_per_feature[0])
    assert all(len(bags) == batch_size for bags in bags_per_feature)
    values = np.array([i for bags in bags_per_feature for bag in bags for i in bag], np.uint64)
    lengths = np.array([[len(bag) for bag in bags] for bags in bags_per_feature], np.int64)
    return SparseBatch.from_bags(KeyedBags(values, lengths), phase=phase)


def _batch(seed: int = 0, batch_size: int = 6, phase: str = "train") -> SparseBatch:
    """Multi-valued bags (some empty); features a and b draw from the same small pool of group-1 IDs."""
    rng = np.random.default_rng(seed)
    features = []
    for _, group, _ in FEATURES:
        pool = [_gid(group, v) for v in range(1, 9)]  # 8 IDs per group: many repeats, a/b overlap surely
        features.append([[int(x) for x in rng.choice(pool, size=rng.integers(0, 4))] for _ in range(batch_size)])
    # Make sure a and b share at least one ID even if the draw did not.
    features[0][0].append(_gid(1, 1))
    features[1][1].append(_gid(1, 1))
    return _sparse(features, phase)


def _index(uniq: np.ndarray, i: int) -> int:
    """Position of ID i in a uint64 array of unique IDs (first-occurrence order, not sorted)."""
    found = np.flatnonzero(uniq == np.uint64(i))
    assert found.shape == (1,)
    return int(found[0])


def _decode(worker: EmbeddingWorker, frame: bytes, batch_size: int) -> Embeddings:
    return Embeddings.decode(frame, worker.values, WIDTHS, batch_size, ids_per_sample=worker.ids_per_sample)


def _feature_rows(emb: Embeddings, sparse: SparseBatch) -> list[np.ndarray]:
    """Split an Embeddings frame's rows back into each feature's rows (features of a width in config order)."""
    out, start = [], {d: 0 for d in set(WIDTHS)}
    for f, dim in enumerate(WIDTHS):
        n = int(emb.counts[f])
        assert n == sparse.uniq[f].shape[0]
        out.append(emb.rows[dim][start[dim]:start[dim] + n])
        start[dim] += n
    for dim, used in start.items():
        assert used == emb.rows[dim].shape[0]
    return out


def test_put_returns_refs_naming_this_replica(cluster):
    refs = [cluster.worker.put(_batch(seed).encode()) for seed in range(3)]
    assert [worker_of_ref(r) for r in refs] == [REPLICA] * 3
    assert len(set(refs)) == 3
    assert set(cluster.worker.buffer) == set(refs)
    assert cluster.calls == []  # put only plans; the PS is not called until a lookup


def test_put_refuses_a_batch_with_the_wrong_number_of_features(cluster):
    sparse = _batch()
    short = SparseBatch(KeyedBags(sparse.bags.values[:sparse.bags.bounds[-2]], sparse.bags.lengths[:-1]),
                        sparse.uniq[:-1])
    with pytest.raises(ValueError, match="4 features"):
        cluster.worker.put(short.encode())
    assert cluster.worker.buffer == {}
    assert not list(cluster.worker.files.directory.glob("*.batch"))


def test_lookup_returns_the_ps_rows_of_every_feature(cluster):
    worker = cluster.worker
    sparse = _batch(seed=1)
    ref = worker.put(sparse.encode())
    emb = _decode(worker, asyncio.run(worker.lookup(ref)), sparse.batch_size)

    assert emb.batch_size == sparse.batch_size
    np.testing.assert_array_equal(emb.counts, [u.shape[0] for u in sparse.uniq])
    np.testing.assert_array_equal(emb.bags.values, sparse.bags.values)  # every feature's positions, in order
    np.testing.assert_array_equal(emb.bags.lengths, sparse.bags.lengths)
    per_feature = _feature_rows(emb, sparse)
    for f, dim in enumerate(WIDTHS):
        expected = cluster.ps_rows(dim, sparse.uniq[f])  # admitted by the worker's train lookup
        assert np.abs(expected).sum() > 0, "train lookup should have admitted (non-zero) rows"
        np.testing.assert_array_equal(per_feature[f], expected)
    # a and b share IDs, hence rows: the same ID reads the same row in both features.
    shared = np.intersect1d(sparse.uniq[0], sparse.uniq[1])
    assert shared.size
    for i in shared:
        ra = per_feature[0][_index(sparse.uniq[0], i)]
        rb = per_feature[1][_index(sparse.uniq[1], i)]
        np.testing.assert_array_equal(ra, rb)
    assert ref in worker.buffer  # a train batch waits for its gradients


def test_each_shard_receives_only_its_own_ids_once(cluster):
    worker = cluster.worker
    sparse = _batch(seed=2, batch_size=20)
    ref = worker.put(sparse.encode())
    asyncio.run(worker.lookup(ref))
    rows_of = worker.rows_of(ref)
    grads = Gradients(ref, {d: np.ones((n, d), np.float32) for d, n in rows_of.items()})
    asyncio.run(worker.push_gradients(Gradients.decode(grads.encode(worker.values), worker.values, worker.rows_of)))

    lookups = [(s, PSLookup.decode(f, WIDTHS)) for s, m, f in cluster.calls if m == "Lookup"]
    updates = [(s, PSUpdate.decode(f, worker.values, WIDTHS)) for s, m, f in cluster.calls if m == "Update"]
    assert sorted(s for s, _ in lookups) == [0, 1] and sorted(s for s, _ in updates) == [0, 1]
    for dim in sorted(set(WIDTHS)):
        batch_ids = np.unique(np.concatenate([sparse.uniq[f] for f, w in enumerate(WIDTHS) if w == dim]))
        for calls in (lookups, updates):
            seen = []
            for shard, frame in calls:
                ids = frame.ids.get(dim, np.zeros(0, np.uint64))
                assert (shard_of(ids, NUM_SHARDS) == shard).all(), f"shard {shard} got another shard's IDs"
                assert np.unique(ids).size == ids.size, "IDs sent to a shard must be deduplicated"
                seen.append(ids)
            np.testing.assert_array_equal(np.sort(np.concatenate(seen)), batch_ids)
    assert all(frame.train for _, frame in lookups)
    # Both shards really hold IDs of this batch (else the split test above would be vacuous).
    assert all(frame.ids[8].size for _, frame in lookups)


def test_push_gradients_sums_shared_ids_and_the_ps_applies_sgd(cluster):
    worker = cluster.worker
    sparse = _batch(seed=3, batch_size=10)
    ref = worker.put(sparse.encode())
    asyncio.run(worker.lookup(ref))
    rows_of = worker.rows_of(ref)
    assert rows_of == {d: int(sum(sparse.uniq[f].size for f, w in enumerate(WIDTHS) if w == d)) for d in (4, 8)}

    # Gradients that are multiples of 1/64: their sums are exact in float32 whatever the order.
    rng = np.random.default_rng(7)
    grads = {d: (rng.integers(-64, 64, (n, d)) / 64).astype(np.float32) for d, n in rows_of.items()}
    before = {d: {} for d in (4, 8)}
    summed = {d: {} for d in (4, 8)}
    start = {4: 0, 8: 0}
    for f, dim in enumerate(WIDTHS):
        for k, i in enumerate(sparse.uniq[f].tolist()):
            g = grads[dim][start[dim] + k]
            summed[dim][i] = summed[dim].get(i, np.zeros(dim, np.float32)) + g
        start[dim] += sparse.uniq[f].size
    for dim in (4, 8):
        ids = np.array(sorted(summed[dim]), np.uint64)
        before[dim] = dict(zip(ids.tolist(), cluster.ps_rows(dim, ids)))
    shared = set(sparse.uniq[0].tolist()) & set(sparse.uniq[1].tolist())
    assert shared, "the batch must hold an ID used by both features of group 1"

    frame = Gradients(ref, grads).encode(worker.values)
    applied = asyncio.run(worker.push_gradients(Gradients.decode(frame, worker.values, worker.rows_of)))
    assert applied.applied == len(summed[4]) + len(summed[8])  # one update per batch-unique ID, not per feature row
    # Each shard's life acknowledged it, and the worker counts that (what a lost store's loss is counted from).
    lives = tuple((s, cluster.applied[s].life) for s in range(NUM_SHARDS))
    assert applied.lives == lives and dict(worker.acks) == {pair: 1 for pair in lives}
    assert [(a.shard, a.life, a.updates) for a in worker.recovery().acks] == [(s, life, 1) for s, life in lives]

    lr = np.float32(LR)
    for dim in (4, 8):
        ids = np.array(sorted(summed[dim]), np.uint64)
        after = cluster.ps_rows(dim, ids)
        for row, i in zip(after, ids.tolist()):
            expected = before[dim][i] + (-lr) * summed[dim][i]
            np.testing.assert_allclose(row, expected, rtol=0, atol=1e-7, err_msg=f"id {i:#x} width {dim}")
    for i in shared:  # the shared IDs moved by the sum of both features' gradients
        k0, k1 = _index(sparse.uniq[0], i), _index(sparse.uniq[1], i)
        both = grads[8][k0] + grads[8][sparse.uniq[0].size + k1]
        moved = cluster.ps_rows(8, [i])[0] - before[8][i]
        np.testing.assert_allclose(moved, (-lr) * both, rtol=0, atol=1e-7)

    # The batch is consumed: its embeddings are not served, and a push of it again is known as applied
    # (the servicer answers it without decoding or applying anything).
    assert ref not in worker.buffer
    with pytest.raises(NotFound):
        asyncio.run(worker.lookup(ref))
    with pytest.raises(NotFound):
        Gradients.decode(frame, worker.values, worker.rows_of)
    with pytest.raises(NotFound):
        asyncio.run(worker.push_gradients(Gradients(ref, grads)))
    assert worker.already_applied(ref) and not worker.already_applied(ref + 1)


def test_an_eval_batch_is_read_once_and_refuses_gradients(cluster):
    worker = cluster.worker
    train = _batch(seed=4)
    asyncio.run(worker.lookup(worker.put(train.encode())))  # admit some rows so the eval lookup reads real values
    sparse = _batch(seed=4, phase="eval")
    ref = worker.put(sparse.encode())
    with pytest.raises(ValueError, match="eval batch"):
        worker.rows_of(ref)
    dims = {8: 1, 4: 1}
    with pytest.raises(ValueError, match="eval batch"):
        Gradients.decode(Gradients(ref, {d: np.ones((n, d), np.float32) for d, n in dims.items()})
                         .encode(worker.values), worker.values, worker.rows_of)

    calls = len(cluster.calls)
    emb = _decode(worker, asyncio.run(worker.lookup(ref)), sparse.batch_size)
    assert all(not PSLookup.decode(f, WIDTHS).train for _, _, f in cluster.calls[calls:])
    for f, rows in enumerate(_feature_rows(emb, sparse)):
        assert np.abs(rows).sum() > 0
        np.testing.assert_array_equal(rows, cluster.ps_rows(WIDTHS[f], sparse.uniq[f]))
    assert ref not in worker.buffer
    # Asked again (as after a restart that beat the answer out), the consumed eval batch is served again.
    assert asyncio.run(worker.lookup(ref)) == asyncio.run(worker.lookup(ref))
    assert ref not in worker.buffer and worker.stats()["lookups_repeated_total"] == 2
    assert not worker.already_applied(ref)


def test_eval_lookup_does_not_admit_new_ids(cluster):
    worker = cluster.worker
    sparse = _batch(seed=5, phase="eval")
    emb = _decode(worker, asyncio.run(worker.lookup(worker.put(sparse.encode()))), sparse.batch_size)
    for dim, rows in emb.rows.items():
        np.testing.assert_array_equal(rows, 0)  # absent IDs read zeros in eval
    for shard in cluster.stores:
        assert all(store.stats()["rows"] == 0 for store in shard.values())


def test_unknown_ref_is_not_found(cluster):
    with pytest.raises(NotFound):
        asyncio.run(cluster.worker.lookup(12345))
    with pytest.raises(NotFound):
        cluster.worker.rows_of(12345)


def test_counters(cluster):
    worker = cluster.worker
    sparse = _batch(seed=6)
    ref = worker.put(sparse.encode())
    assert worker.stats()["unapplied_train_batches"] == 0  # buffered, but nobody has trained on it yet
    asyncio.run(worker.lookup(ref))
    assert worker.stats()["unapplied_train_batches"] == 1  # looked up: an update is owed until it is applied
    assert worker.recovery().unapplied_train_batches == 1
    rows_of = worker.rows_of(ref)
    applied = asyncio.run(worker.push_gradients(
        Gradients(ref, {d: np.ones((n, d), np.float32) for d, n in rows_of.items()})))
    unique = sum(np.unique(np.concatenate([sparse.uniq[f] for f, w in enumerate(WIDTHS) if w == d])).size
                 for d in (4, 8))
    stats = worker.stats()
    assert applied.applied == unique
    assert stats == {"batches_put_total": 1.0, "lookups_total": 1.0, "gradient_pushes_total": 1.0,
                     "updates_discarded_total": 0.0, "rows_looked_up_total": float(unique),
                     "rows_updated_total": float(unique), "buffered_batches": 0.0, "unapplied_train_batches": 0.0,
                     "batches_recovered_total": 0.0, "pushes_already_applied_total": 0.0,
                     "lookups_repeated_total": 0.0, "puts_held_back_total": 0.0, "buffered_bytes": 0.0}


def test_only_repeated_ids_are_deduplicated_again(cluster):
    """Width 4 (feature c alone) takes the data loader's per-feature uniques as they are; width 8, where a and
    b (both group 1) share IDs, is merged; a batch where they happen not to meet is not; and a frame whose
    "unique" IDs repeat is merged too (checked, not assumed)."""
    worker = cluster.worker
    batch = worker.buffer[worker.put(_batch(seed=4, batch_size=12).encode())]
    assert batch.gidx[4] is None and batch.gidx[8] is not None
    assert np.unique(batch.uniq[8]).size == batch.uniq[8].size < sum(batch.sparse.uniq[f].size for f in (0, 1, 3))
    bags = [[[_gid(1, 1)]], [[_gid(1, 2)]], [[_gid(2, 1)]], [[_gid(3, 1)]]]
    plan = worker._plan(0, _sparse(bags))
    assert plan.gidx[8] is None and plan.uniq[8].tolist() == [_gid(1, 1), _gid(1, 2), _gid(3, 1)]
    repeated = _sparse(bags)
    repeated.uniq[3] = np.array([_gid(3, 1), _gid(3, 1)], np.uint64)  # a frame whose "unique" IDs repeat
    pos = repeated.bags.values.copy()
    bounds = repeated.bags.bounds
    assert bounds[4] - bounds[3] == 1
    pos[bounds[3]:bounds[4]] = np.array([1], np.uint16)
    repeated.bags = KeyedBags(pos, repeated.bags.lengths)
    plan = worker._plan(0, repeated)
    assert plan.gidx[8] is not None and np.unique(plan.uniq[8]).size == plan.uniq[8].size == 3


def test_a_full_buffer_holds_puts_back_until_a_batch_is_consumed_and_survives_a_restart(cluster, tmp_path):
    """ps.worker_buffer_bytes caps what the worker keeps: past it a put is UNAVAILABLE (the data loader retries:
    back-pressure), and once a batch is consumed the next fits. A restarted worker counts what it re-attached."""
    from hybridrec.core.runtime.rpc import Unavailable

    frames = [_batch(seed).encode() for seed in range(4)]
    cap = len(frames[0]) + len(frames[1]) + len(frames[2]) // 2
    cluster.worker.buffer_cap = cap
    first, second = (cluster.worker.put(f) for f in frames[:2])
    with pytest.raises(Unavailable, match=r"would pass ps.worker_buffer_bytes"):
        cluster.worker.put(frames[2])
    assert cluster.worker.stats()["puts_held_back_total"] == 1
    _decode(cluster.worker, asyncio.run(cluster.worker.lookup(first)), 6)
    rows_of = cluster.worker.rows_of(first)
    asyncio.run(cluster.worker.push_gradients(Gradients(first, {d: np.ones((n, d), np.float32)
                                                                for d, n in rows_of.items()})))
    third = cluster.worker.put(frames[2])
    assert set(cluster.worker.buffer) == {second, third}
    assert cluster.worker.buffered_bytes == len(frames[1]) + len(frames[2])
    cluster.worker.close()
    again = EmbeddingWorker(cluster.config, REPLICA, cluster.ps_call)  # a restarted worker, the same directory
    assert again.buffered_bytes == len(frames[1]) + len(frames[2])
    cluster.worker = again
