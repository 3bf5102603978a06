"""PS checkpoints: exact round trip, re-sharding 2 -> 3, and refusal of damaged or mismatched dumps."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hybridrec.core.wire.sharding import shard_of
from services.embedding_ps.checkpoint import dump_shard, inspect_checkpoint, load_shard, shard_dir_name
from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig
from services.embedding_ps.store import EmbeddingStore, StoreConfig

DIMS = (4, 8)
ADAM = EmbeddingOptimizerConfig(name="adam", lr=0.05)


def cfg(dim: int, optimizer: EmbeddingOptimizerConfig = ADAM, capacity: int = 2000) -> StoreConfig:
    return StoreConfig(dim=dim, optimizer=optimizer, ps=PSConfig(capacity=capacity, num_stripes=4), seed=2)


@pytest.fixture
def stores(tmp_path):
    """stores(name) -> {dim: store} of fresh stores; all closed at the end."""
    opened = []

    def make(name: str, optimizer: EmbeddingOptimizerConfig = ADAM, dims=DIMS, capacity: int = 2000):
        group = {d: EmbeddingStore.open(tmp_path / "shm" / name / f"dim{d}", cfg(d, optimizer, capacity))
                 for d in dims}
        opened.extend(group.values())
        return group

    yield make
    for store in opened:
        store.close()


def fill(group: dict[int, EmbeddingStore], keys: np.ndarray, seed: int = 0) -> None:
    """Insert keys and give them optimizer state by a few updates."""
    rng = np.random.default_rng(seed)
    for dim, store in group.items():
        store.lookup(keys, train=True)
        for _ in range(3):
            sub = np.unique(rng.choice(keys, len(keys) // 2))
            store.update(sub, rng.standard_normal((len(sub), dim)).astype(np.float32))


def as_dict(store: EmbeddingStore) -> dict[int, bytes]:
    keys, values = store.items()
    return {int(k): v.tobytes() for k, v in zip(keys, values)}


def test_round_trip_is_exact_and_keeps_recency(tmp_path, stores):
    src = stores("src")
    fill(src, np.arange(500, dtype=np.uint64) * 7919)
    manifest = dump_shard(src, tmp_path / "ckpt", shard=0, num_shards=1, step=42)
    assert manifest["step"] == 42 and manifest["tables"]["8"]["num_rows"] == 500
    dst = stores("dst")
    result = load_shard(tmp_path / "ckpt", dst, shard=0, num_shards=1, shard_of=lambda ids: shard_of(ids, 1))
    assert result == {"step": 42, "rows": {4: 500, 8: 500}, "source_shards": 1, "applied_by_life": {}}
    for dim in DIMS:
        k1, v1 = src[dim].items()
        k2, v2 = dst[dim].items()
        np.testing.assert_array_equal(k1, k2)  # same LRU order, stripe by stripe
        np.testing.assert_array_equal(v1, v2)
        dst[dim].check_consistency()
    info = inspect_checkpoint(tmp_path / "ckpt")
    assert info["num_shards"] == 1 and info["step"] == 42 and info["rows"] == {"4": 500, "8": 500}
    assert not [p for p in (tmp_path / "ckpt" / "ps").iterdir() if p.name.startswith(".")]


def test_two_shards_reload_into_three(tmp_path, stores):
    all_keys = np.arange(3000, dtype=np.uint64) * 104729 + 11
    old = [stores(f"old{s}") for s in range(2)]
    for s, group in enumerate(old):
        fill(group, all_keys[shard_of(all_keys, 2) == s], seed=s)
        dump_shard(group, tmp_path / "ckpt", shard=s, num_shards=2, step=7)
    expected = {d: {**as_dict(old[0][d]), **as_dict(old[1][d])} for d in DIMS}
    assert len(expected[4]) == 3000
    new = [stores(f"new{s}") for s in range(3)]
    for s, group in enumerate(new):
        result = load_shard(tmp_path / "ckpt", group, shard=s, num_shards=3,
                            shard_of=lambda ids: shard_of(ids, 3))
        assert result["source_shards"] == 2 and result["step"] == 7
    for d in DIMS:
        union: dict[int, bytes] = {}
        for s, group in enumerate(new):
            rows = as_dict(group[d])
            keys = np.array(list(rows), dtype=np.uint64)
            assert np.all(shard_of(keys, 3) == s), "a row landed in the wrong shard"
            assert not set(rows) & set(union)
            union.update(rows)
            group[d].check_consistency()
        assert union == expected[d]


def test_dump_replaces_previous_dump_of_the_shard(tmp_path, stores):
    group = stores("a")
    fill(group, np.arange(10, dtype=np.uint64))
    dump_shard(group, tmp_path / "ckpt", shard=0, num_shards=1, step=1)
    fill(group, np.arange(10, 30, dtype=np.uint64))
    dump_shard(group, tmp_path / "ckpt", shard=0, num_shards=1, step=2)
    info = inspect_checkpoint(tmp_path / "ckpt")
    assert info["step"] == 2 and info["rows"]["4"] == 30
    assert [p.name for p in (tmp_path / "ckpt" / "ps").iterdir()] == [shard_dir_name(0, 1)]


def test_failed_dump_leaves_no_partial_shard(tmp_path, stores):
    group = stores("a")
    fill(group, np.arange(10, dtype=np.uint64))
    dump_shard(group, tmp_path / "ckpt", shard=0, num_shards=1, step=1)

    class Broken:
        config = group[8].config
        dumped = 1

        def stream_rows(self, **_):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        dump_shard({4: group[4], 8: Broken()}, tmp_path / "ckpt", shard=0, num_shards=1, step=2)
    assert [p.name for p in (tmp_path / "ckpt" / "ps").iterdir()] == [shard_dir_name(0, 1)]
    assert inspect_checkpoint(tmp_path / "ckpt")["step"] == 1
    assert group[4].dumped is None  # its copied rows' marks went with the failed dump: the next one is full


@pytest.fixture
def checkpoint(tmp_path, stores):
    """A valid 2-shard checkpoint; returns its ps/ directory."""
    keys = np.arange(400, dtype=np.uint64)
    for s in range(2):
        group = stores(f"src{s}")
        fill(group, keys[shard_of(keys, 2) == s], seed=s)
        dump_shard(group, tmp_path / "ckpt", shard=s, num_shards=2, step=3)
    return tmp_path / "ckpt" / "ps"


def corrupt_byte(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-64])


def edit_manifest(ps_dir, shard, fn):
    path = ps_dir / shard_dir_name(shard, 2) / "manifest.json"
    manifest = json.loads(path.read_text())
    fn(manifest)
    path.write_text(json.dumps(manifest))


DAMAGE = {
    "corrupt values": (lambda d: corrupt_byte(d / shard_dir_name(1, 2) / "dim8.00000.values.npy"), "sha256"),
    "corrupt keys": (lambda d: corrupt_byte(d / shard_dir_name(0, 2) / "dim4.00000.keys.npy"), "sha256"),
    "truncated": (lambda d: truncate(d / shard_dir_name(1, 2) / "dim4.00000.values.npy"), "truncated"),
    "missing file": (lambda d: (d / shard_dir_name(0, 2) / "dim8.00000.keys.npy").unlink(), "missing"),
    "missing shard": (lambda d: __import__("shutil").rmtree(d / shard_dir_name(1, 2)), "missing"),
    "bad json": (lambda d: (d / shard_dir_name(0, 2) / "manifest.json").write_text("{not json"), "manifest"),
    "other step": (lambda d: edit_manifest(d, 1, lambda m: m.update(step=4)), "steps"),
    "other version": (lambda d: edit_manifest(d, 0, lambda m: m.update(format_version=99)), "format_version"),
    "wrong shard": (lambda d: edit_manifest(d, 0, lambda m: m.update(shard=1)), "directory"),
    "row count": (lambda d: edit_manifest(d, 1, lambda m: m["tables"]["4"].update(num_rows=3)), "match"),
    "no tables": (lambda d: edit_manifest(d, 1, lambda m: m.pop("tables")), "malformed"),
    "path in file name": (lambda d: edit_manifest(
        d, 1, lambda m: m["tables"]["4"]["parts"][0]["keys"].update(file="../x.npy")), "malformed"),
}


DAMAGED_SHARD = {"corrupt values": 1, "corrupt keys": 0, "truncated": 1, "missing file": 0, "row count": 1,
                 "no tables": 1, "path in file name": 1, "other version": 0, "wrong shard": 0}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
@pytest.mark.parametrize("num_shards", [2, 3])
def test_damaged_checkpoint_is_refused_with_nothing_loaded(checkpoint, stores, damage, num_shards):
    fn, message = DAMAGE[damage]
    fn(checkpoint)
    for s in range(num_shards):
        dst = stores(f"dst{s}")
        try:
            load_shard(checkpoint.parent, dst, shard=s, num_shards=num_shards,
                       shard_of=lambda ids: shard_of(ids, num_shards))
        except ValueError as exc:
            assert message in str(exc)
            assert all(store.stats()["rows"] == 0 for store in dst.values()), "refused, yet rows were loaded"
        else:
            # Only an unchanged shard count may skip other shards' dumps; a shard-local damage
            # (not a checkpoint-wide one) in another shard's dump is then legitimately unseen.
            assert num_shards == 2 and DAMAGED_SHARD.get(damage, s) != s, f"shard {s} loaded a damaged checkpoint"


def test_mismatched_stores_are_refused(checkpoint, stores):
    with pytest.raises(ValueError, match="widths"):
        load_shard(checkpoint, stores("w", dims=(4,)), shard=0, num_shards=2, shard_of=lambda i: shard_of(i, 2))
    other = stores("o", optimizer=EmbeddingOptimizerConfig(name="adagrad"))
    with pytest.raises(ValueError, match="checkpoint holds adam rows of fp32 weights .* the store adagrad rows"):
        load_shard(checkpoint, other, shard=0, num_shards=2, shard_of=lambda i: shard_of(i, 2))
    assert all(store.stats()["rows"] == 0 for store in other.values())


def test_same_shard_count_with_another_shard_function_is_refused(checkpoint, stores):
    dst = stores("dst")
    with pytest.raises(ValueError, match="do not belong"):
        load_shard(checkpoint, dst, shard=0, num_shards=2, shard_of=lambda ids: (ids % np.uint64(2)).astype(int))
    assert all(store.stats()["rows"] == 0 for store in dst.values())


def test_empty_or_absent_checkpoint_is_refused(tmp_path, stores):
    with pytest.raises(ValueError, match="no PS checkpoint"):
        load_shard(tmp_path / "nope", stores("a"), shard=0, num_shards=1, shard_of=lambda i: shard_of(i, 1))
    (tmp_path / "empty" / "ps").mkdir(parents=True)
    with pytest.raises(ValueError, match="no PS shard dumps"):
        inspect_checkpoint(tmp_path / "empty")
