"""Incremental PS checkpoints: deltas hold exactly the changed rows, a chain (full + deltas) restores every row
and its optimizer state bit for bit, also into another shard count, a damaged or missing link is refused naming
its file, and a dump streams in bounded memory. Real stores, real files."""
from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from hybridrec.core.layouts import checkpoints
from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig
from hybridrec.core.wire.sharding import shard_of
from services.embedding_ps.checkpoint import (dump_memory_bytes, dump_shard, inspect_checkpoint, load_shard,
                                              read_embeddings, row_bytes, shard_dir_name)
from services.embedding_ps.store import EmbeddingStore, StoreConfig

DIMS = (4, 8)
ADAGRAD = EmbeddingOptimizerConfig(name="adagrad", lr=0.05)


def cfg(dim: int, capacity: int = 4000, num_stripes: int = 4, ttl: bool = False) -> StoreConfig:
    lifecycle = {"ttl_s": 3600.0} if ttl else {}
    return StoreConfig(dim=dim, optimizer=ADAGRAD, seed=3,
                       ps=PSConfig(capacity=capacity, num_stripes=num_stripes, lifecycle=lifecycle))


@pytest.fixture
def stores(tmp_path):
    """stores(name, **cfg) -> {dim: store}; all closed at the end."""
    opened = []

    def make(name: str, dims=DIMS, **kwargs) -> dict[int, EmbeddingStore]:
        group = {d: EmbeddingStore.open(tmp_path / "shm" / name / f"dim{d}", cfg(d, **kwargs)) for d in dims}
        opened.extend(group.values())
        return group

    yield make
    for store in opened:
        store.close()


def train(group: dict[int, EmbeddingStore], keys: np.ndarray, seed: int) -> None:
    """A training lookup of `keys` (inserting the new ones), then one update of each."""
    rng = np.random.default_rng(seed)
    for dim, store in group.items():
        store.lookup(keys, train=True)
        store.update(keys, rng.standard_normal((len(keys), dim)).astype(np.float32))


def as_dict(store: EmbeddingStore) -> dict[int, bytes]:
    keys, values = store.items()
    return {int(k): v.tobytes() for k, v in zip(keys, values)}


def dump(group, root: Path, step: int, base: int | None, *, shard: int = 0, num_shards: int = 1,
         full_every: int = 8) -> dict:
    return dump_shard(group, checkpoints.step_dir(root, step), shard=shard, num_shards=num_shards, step=step,
                      base=base, full_every=full_every)


def test_a_delta_holds_the_changed_rows_and_the_chain_restores_every_row_bit_for_bit(tmp_path, stores):
    root, src = tmp_path / "ckpt", stores("src")
    train(src, np.arange(1, 2001, dtype=np.uint64), seed=0)
    full = dump(src, root, 10, None)
    assert not full["delta"] and full["chain"] == [10] and full["tables"]["8"]["num_rows"] == 2000
    changed = np.arange(1500, 2301, dtype=np.uint64)  # 501 updated rows and 300 new ones
    train(src, changed, seed=1)
    assert src[8].changed_rows() == 801
    delta = dump(src, root, 20, 10)
    assert delta["delta"] and delta["chain"] == [10, 20]
    for dim in DIMS:
        table = delta["tables"][str(dim)]
        written = np.concatenate([np.load(root / "step-00000020" / "ps" / shard_dir_name(0, 1) / p["keys"]["file"])
                                  for p in table["parts"]])
        assert sorted(written.tolist()) == changed.tolist()  # exactly the changed rows
        row = row_bytes(src[dim].config)
        files = sum(p[name]["bytes"] for p in table["parts"] for name in ("keys", "values"))
        assert files <= 1.1 * len(changed) * row + 256 * len(table["parts"])  # npy headers aside
    train(src, np.arange(2200, 2251, dtype=np.uint64), seed=2)
    third = dump(src, root, 30, 20)
    assert third["chain"] == [10, 20, 30] and third["tables"]["4"]["num_rows"] == 51
    dst = stores("dst")
    result = load_shard(checkpoints.step_dir(root, 30), dst, shard=0, num_shards=1,
                        shard_of=lambda ids: shard_of(ids, 1))
    assert result["step"] == 30
    for dim in DIMS:
        assert as_dict(dst[dim]) == as_dict(src[dim])
        dst[dim].check_consistency()
    _, tables = read_embeddings(checkpoints.step_dir(root, 30))  # export follows the chain too
    for _, dim, keys, rows in tables:
        expected = as_dict(src[dim])
        assert len(keys) == len(expected) == 2300
        for k, r in zip(keys[::97], rows[::97]):
            assert np.frombuffer(expected[int(k)], np.float32)[:dim].tobytes() == np.asarray(r).tobytes()


def test_touched_stamps_travel_in_deltas(tmp_path, stores):
    root, src = tmp_path / "ckpt", stores("src", ttl=True)
    train(src, np.arange(1, 301, dtype=np.uint64), seed=0)
    for store in src.values():
        store.tick()
    dump(src, root, 1, None)
    train(src, np.arange(250, 400, dtype=np.uint64), seed=1)
    assert dump(src, root, 2, 1)["delta"]
    dst = stores("dst", ttl=True)
    load_shard(checkpoints.step_dir(root, 2), dst, shard=0, num_shards=1, shard_of=lambda ids: shard_of(ids, 1))
    for dim in DIMS:
        k1, v1, t1 = src[dim].snapshot()
        k2, v2, t2 = dst[dim].snapshot()
        order1, order2 = np.argsort(k1), np.argsort(k2)
        np.testing.assert_array_equal(k1[order1], k2[order2])
        np.testing.assert_array_equal(v1[order1], v2[order2])
        np.testing.assert_array_equal(t1[order1], t2[order2])


def test_a_dump_is_full_when_the_chain_is_long_most_rows_changed_or_changes_are_unknown(tmp_path, stores):
    root, src = tmp_path / "ckpt", stores("src")
    train(src, np.arange(1, 1001, dtype=np.uint64), seed=0)
    assert not dump(src, root, 1, None, full_every=3)["delta"]
    train(src, np.arange(1, 11, dtype=np.uint64), seed=1)
    assert dump(src, root, 2, 1, full_every=3)["chain"] == [1, 2]
    train(src, np.arange(1, 11, dtype=np.uint64), seed=2)
    assert dump(src, root, 3, 2, full_every=3)["chain"] == [1, 2, 3]
    train(src, np.arange(1, 11, dtype=np.uint64), seed=3)
    assert dump(src, root, 4, 3, full_every=3)["chain"] == [4]  # three dumps: a new chain
    train(src, np.arange(1, 601, dtype=np.uint64), seed=4)
    assert dump(src, root, 5, 4, full_every=3)["chain"] == [5]  # over half the rows changed
    assert dump(src, root, 6, 4, full_every=3)["chain"] == [6]  # the job names a base this shard did not dump
    train(src, np.arange(1, 11, dtype=np.uint64), seed=5)
    assert dump(src, root, 7, 6, full_every=1)["chain"] == [7]  # full_every 1: always full
    assert dump(src, root, 7, 7)["chain"] == [7]  # the base's own step again (a final checkpoint): full
    src[4].load_rows(np.array([5], np.uint64), np.zeros((1, 8), np.float32))  # a restore: changes unmarked
    assert src[4].dumped is None
    assert dump(src, root, 8, 7)["chain"] == [8]


def test_two_shards_chains_reload_into_three(tmp_path, stores):
    root = tmp_path / "ckpt"
    keys = np.arange(1, 3001, dtype=np.uint64) * 104729
    old = [stores(f"old{s}") for s in range(2)]
    for s, group in enumerate(old):
        mine = keys[shard_of(keys, 2) == s]
        train(group, mine, seed=s)
        dump(group, root, 5, None, shard=s, num_shards=2)
        train(group, mine[::3], seed=10 + s)
        assert dump(group, root, 6, 5, shard=s, num_shards=2)["delta"]
    expected = {d: {**as_dict(old[0][d]), **as_dict(old[1][d])} for d in DIMS}
    union: dict[int, dict[int, bytes]] = {d: {} for d in DIMS}
    for s in range(3):
        group = stores(f"new{s}")
        result = load_shard(checkpoints.step_dir(root, 6), group, shard=s, num_shards=3,
                            shard_of=lambda ids: shard_of(ids, 3))
        assert result["source_shards"] == 2
        for d in DIMS:
            rows = as_dict(group[d])
            assert np.all(shard_of(np.array(list(rows), np.uint64), 3) == s)
            union[d].update(rows)
    assert union == expected


@pytest.fixture
def chain(tmp_path, stores):
    """A one-shard chain 1 (full) -> 2 -> 3 under ckpt/; returns the checkpoint root."""
    root, src = tmp_path / "ckpt", stores("src")
    train(src, np.arange(1, 501, dtype=np.uint64), seed=0)
    dump(src, root, 1, None)
    for step in (2, 3):
        train(src, np.arange(step * 100, step * 100 + 50, dtype=np.uint64), seed=step)
        dump(src, root, step, step - 1)
    return root


def _shard(root: Path, step: int) -> Path:
    return checkpoints.step_dir(root, step) / "ps" / shard_dir_name(0, 1)


DAMAGE = {
    "missing link": (lambda root: shutil.rmtree(_shard(root, 2)), "step-00000002/ps/shard-00000-of-00001/manifest.json"),
    "corrupt link": (lambda root: (_shard(root, 1) / "dim8.00000.values.npy").write_bytes(b"x" * 100),
                     "step-00000001/ps/shard-00000-of-00001/dim8.00000.values.npy"),
    "link of another chain": (lambda root: _edit(_shard(root, 2), lambda m: m.update(chain=[0, 2])),
                              "step-00000002/ps/shard-00000-of-00001/manifest.json"),
}


def _edit(shard: Path, fn) -> None:
    manifest = json.loads((shard / "manifest.json").read_text())
    fn(manifest)
    (shard / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_chain_is_refused_naming_the_file_with_nothing_loaded(chain, stores, damage):
    do, names = DAMAGE[damage]
    do(chain)
    dst = stores("dst")
    with pytest.raises(ValueError, match=names):
        load_shard(checkpoints.step_dir(chain, 3), dst, shard=0, num_shards=1, shard_of=lambda ids: shard_of(ids, 1))
    assert all(store.num_rows == 0 for store in dst.values())


def test_prune_keeps_what_kept_checkpoints_build_on_and_latest_skips_a_broken_chain(tmp_path):
    root = tmp_path / "ckpt"
    for step, chain in ((1, []), (2, [1]), (3, [1, 2]), (4, []), (5, [4])):
        path = checkpoints.step_dir(root, step)
        path.mkdir(parents=True)
        checkpoints.write_manifest(path, checkpoints.JobManifest(step=step, seq=0, position=[0, 0, 0, 0],
                                                                 chain=chain))
    assert checkpoints.prune(root, 1) == [1, 2, 3]  # 5 needs 4 only: the old chain goes whole
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]
    shutil.rmtree(checkpoints.step_dir(root, 4))
    assert checkpoints.latest(root) is None  # 5's chain is broken: not a checkpoint to resume from


def test_inspect_lists_each_shards_chain(chain):
    info = inspect_checkpoint(checkpoints.step_dir(chain, 3))
    assert info["chains"] == {0: [1, 2, 3]} and info["rows"] == {"4": 50, "8": 50}


def test_a_dump_adds_at_most_its_chunk_and_one_stripes_order_to_memory(tmp_path, stores):
    """The bound asserted is the one `hybridrec plan` counts (`dump_memory_bytes`), and it is a small fraction
    of the table: the old dump copied the whole table twice."""
    group = stores("big", dims=(16,), capacity=400_000, num_stripes=8)
    store = group[16]
    keys = np.arange(1, 300_001, dtype=np.uint64)
    for at in range(0, keys.size, 50_000):
        train(group, keys[at:at + 50_000], seed=at)
    table = store.num_rows * row_bytes(store.config)
    chunk = 2 << 20
    dump_shard(group, tmp_path / "warm", shard=0, num_shards=1, step=0)  # kernels compiled outside the trace
    tracemalloc.start()
    try:
        dump_shard(group, tmp_path / "ckpt" / "step-00000001", shard=0, num_shards=1, step=1, chunk_bytes=chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    bound = dump_memory_bytes(store.config, chunk)
    assert peak <= bound + (1 << 20), (peak, bound)  # 1 MiB for manifests, hashing and file buffers
    assert bound < table / 4, (bound, table)
    info = inspect_checkpoint(tmp_path / "ckpt" / "step-00000001")
    assert info["rows"] == {"16": 300_000} and len(info["shards"][0]["tables"]["16"]["parts"]) > 10


@pytest.mark.parametrize("tries", [8, 0], ids=["lock-free", "locked"])
def test_a_dump_under_training_copies_every_row_once_and_whole(stores, monkeypatch, tries):
    """The dump copies rows without the stripes' locks while a thread trains every row: each stream still holds
    every live row exactly once (the LRU links were copied whole) and no row half-updated. Adagrad with a
    gradient equal across a row's columns keeps its accumulator columns equal, so a torn copy would show as
    unequal ones (wide rows, one stripe and large batches make the overlaps frequent). With no retries allowed
    every copy is taken under the lock instead."""
    import threading

    from services.embedding_ps import store as store_module
    monkeypatch.setattr(store_module, "COPY_TRIES", tries)
    dim = 128
    store = stores("live", dims=(dim,), capacity=120000, num_stripes=1)[dim]
    keys = np.arange(1, 100001, dtype=np.uint64)
    store.lookup(keys, train=True)
    start, stop = threading.Barrier(2), threading.Event()

    def trainer() -> None:
        rng = np.random.default_rng(0)
        grads = np.ones((len(keys), dim), np.float32)
        start.wait()
        while not stop.is_set():
            batch = rng.permutation(keys)
            store.lookup(batch, train=True)
            store.update(batch, grads)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        start.wait()
        for _ in range(4):
            streamed, accumulators = [], []
            for k, v, _ in store.stream_rows(chunk_rows=50000, batch_rows=20000):
                streamed.append(k.copy())
                accumulators.append(v[:, dim:].copy())
            streamed = np.concatenate(streamed)
            acc = np.concatenate(accumulators)
            assert np.array_equal(np.sort(streamed), keys)
            assert np.array_equal(acc, np.repeat(acc[:, :1], dim, axis=1))
            assert store.dump_copies["copies"] > 0
            if tries == 0:
                assert store.dump_copies["locked"] == store.dump_copies["copies"]
    finally:
        stop.set()
        thread.join()
    assert np.any(acc > 0)  # the trainer's updates reached the copies
