"""Live versions (hybridrec/core/layouts/versions.py): copy-on-write delta merge, compaction, a follower skipping broken
or
half-written versions and keeping what it serves."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hybridrec.core.layouts.bundle import BundleManifest, EmbeddingTable, file_entry, table_files
from hybridrec.core.config import FeatureConfig, ModelConfig
from hybridrec.core.layouts.files import write_json_atomic
from hybridrec.core.wire.sharding import shard_of
from hybridrec.core.layouts.versions import (ArrayShardTable, Follower, chain_to, compact, kept_versions, list_versions,
                                merge_rows, merge_tables, newest_version_number, table_arrays, version_dir,
                                write_table)

FEATURES = [FeatureConfig(name="C1", group=0, dim=4), FeatureConfig(name="C2", group=1, dim=8)]
WIDTHS = [4, 8]
SHARDS = 2


def publish(root, version, tables: dict[int, tuple[np.ndarray, np.ndarray]], *, base=None, manifest=True,
            dense=None, model_kwargs=None):
    """Write a version as the PS shards and rank 0 would: tables per shard, dense.pt, manifest last."""
    path = version_dir(root, version)
    files, rows = {}, {}
    for dim, (keys, values) in tables.items():
        owner = shard_of(keys, SHARDS)
        for shard in range(SHARDS):
            files.update(write_table(path, shard, SHARDS, dim, keys[owner == shard], values[owner == shard]))
        rows[dim] = int(keys.shape[0])
    torch.save(dense or {"w": torch.full((2,), float(version))}, path / "dense.pt")
    files["dense.pt"] = file_entry(path / "dense.pt")
    if manifest:
        m = BundleManifest(version=version, base_version=base, step=10 * version, features=FEATURES, num_dense=3,
                           model=ModelConfig(kwargs=model_kwargs or {}), num_shards=SHARDS, rows=rows, files=files)
        write_json_atomic(path / "manifest.json", m.model_dump(mode="json"))
    return path


def random_tables(rng, n, key_space=5000):
    out = {}
    for dim in WIDTHS:
        keys = rng.choice(key_space, size=n, replace=False).astype(np.uint64) + 1
        out[dim] = (keys, rng.standard_normal((n, dim)).astype(np.float32))
    return out


def as_dict(table: EmbeddingTable, dim: int) -> dict[int, np.ndarray]:
    keys, rows = table_arrays(table, dim)
    return dict(zip(keys.tolist(), rows))


def test_merge_rows_replaces_and_adds_and_leaves_the_inputs_alone():
    keys = np.array([1, 3, 5, 7], np.uint64)
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    keys.flags.writeable = rows.flags.writeable = False  # like a memory-mapped table a request may read
    before = (keys.copy(), rows.copy())
    new_keys = np.array([0, 3, 6, 7, 9], np.uint64)
    new_rows = -np.arange(1, 11, dtype=np.float32).reshape(5, 2)
    k, r = merge_rows(keys, rows, new_keys, new_rows)
    assert k.tolist() == [0, 1, 3, 5, 6, 7, 9]
    expect = {0: [-1, -2], 1: [0, 1], 3: [-3, -4], 5: [4, 5], 6: [-5, -6], 7: [-7, -8], 9: [-9, -10]}
    assert {int(a): b.tolist() for a, b in zip(k, r)} == expect
    np.testing.assert_array_equal(keys, before[0])
    np.testing.assert_array_equal(rows, before[1])
    shuffled = np.array([4, 9, 0, 3, 9, 7, 6], np.uint64)  # unsorted and repeated: the last value wins
    k2, r2 = merge_rows(keys, rows, shuffled, np.arange(7, dtype=np.float32)[:, None].repeat(2, 1))
    assert k2.tolist() == [0, 1, 3, 4, 5, 6, 7, 9]
    assert r2[:, 0].tolist() == [2, 0, 3, 0, 4, 6, 5, 4] and r2[1, 1] == 1
    rng = np.random.default_rng(7)
    for _ in range(50):  # the fast path against a dictionary
        base = np.unique(rng.integers(0, 300, rng.integers(0, 100))).astype(np.uint64)
        delta = np.unique(rng.integers(0, 300, rng.integers(1, 100))).astype(np.uint64)
        brows, drows = rng.standard_normal((base.size, 3)), rng.standard_normal((delta.size, 3))
        want = dict(zip(base.tolist(), brows.tolist()))
        want.update(zip(delta.tolist(), drows.tolist()))
        gk, gr = merge_rows(base, brows.astype(np.float32), delta, drows.astype(np.float32))
        assert gk.tolist() == sorted(want)
        np.testing.assert_array_equal(gr, np.array([want[k] for k in sorted(want)], np.float32))
    empty_k, empty_r = merge_rows(np.zeros(0, np.uint64), np.zeros((0, 2), np.float32), new_keys, new_rows)
    assert empty_k.tolist() == new_keys.tolist() and np.array_equal(empty_r, new_rows)


def test_merge_tables_is_copy_on_write(tmp_path):
    rng = np.random.default_rng(0)
    base_tables = random_tables(rng, 1000)
    publish(tmp_path, 1, base_tables)
    follower = Follower(tmp_path)
    first = follower.poll()
    old_table = first.table
    old_view = {dim: as_dict(old_table, dim) for dim in WIDTHS}
    # the delta: 200 existing rows replaced, 300 new ones
    delta = {}
    for dim, (keys, _) in base_tables.items():
        fresh = np.setdiff1d(np.arange(6000, 9000, dtype=np.uint64), keys)[:300]
        changed = np.concatenate([keys[:200], fresh])
        delta[dim] = (changed, rng.standard_normal((changed.size, dim)).astype(np.float32))
    publish(tmp_path, 2, delta, base=1)
    second = follower.poll()
    assert second.version == 2 and follower.current is second and second.table is not old_table
    for dim in WIDTHS:
        got = as_dict(second.table, dim)
        want = dict(old_view[dim])
        want.update(zip(delta[dim][0].tolist(), delta[dim][1]))
        assert got.keys() == want.keys() and len(got) == 1300
        for key, row in want.items():
            np.testing.assert_array_equal(got[key], row)
        assert {k: v.tolist() for k, v in as_dict(old_table, dim).items()} == \
               {k: v.tolist() for k, v in old_view[dim].items()}  # the table a request may hold: unchanged
        probe = np.array(list(want)[:50] + [123456789], np.uint64)
        looked = second.table.lookup(dim, probe)
        np.testing.assert_array_equal(looked[:-1], np.stack([want[k] for k in probe[:-1].tolist()]))
        assert not looked[-1].any()
    assert float(second.dense_state["w"][0]) == 2.0


def test_deltas_merged_onto_a_full_snapshot_equal_a_full_snapshot(tmp_path):
    rng = np.random.default_rng(1)
    state = {dim: {} for dim in WIDTHS}
    tables = random_tables(rng, 800)
    for dim, (k, v) in tables.items():
        state[dim].update(zip(k.tolist(), v))
    publish(tmp_path / "a", 1, tables)
    for version in range(2, 6):
        delta = random_tables(rng, 150, key_space=8000)
        for dim, (k, v) in delta.items():
            state[dim].update(zip(k.tolist(), v))
        publish(tmp_path / "a", version, delta, base=version - 1)
    full = {dim: (np.array(list(s), np.uint64), np.stack(list(s.values()))) for dim, s in state.items()}
    publish(tmp_path / "b", 5, full)
    merged, snapshot = Follower(tmp_path / "a").poll(), Follower(tmp_path / "b").poll()
    assert merged.version == snapshot.version == 5
    for dim in WIDTHS:
        for a, b in zip(table_arrays(merged.table, dim), table_arrays(snapshot.table, dim)):
            np.testing.assert_array_equal(a, b)


def test_a_follower_skips_broken_and_half_written_versions_and_keeps_serving(tmp_path):
    rng = np.random.default_rng(2)
    publish(tmp_path, 1, random_tables(rng, 100))
    follower = Follower(tmp_path)
    assert follower.poll().version == 1
    publish(tmp_path, 2, random_tables(rng, 10), base=1, manifest=False)  # still being written
    assert follower.poll() is None and follower.current.version == 1 and 2 not in follower.skipped
    # a corrupt delta: refused, named, the previous version keeps serving
    bad = publish(tmp_path, 3, random_tables(rng, 10), base=1)
    with open(bad / table_files(0, SHARDS, 8)[1], "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\xc0\x7f")
    assert follower.poll() is None and follower.current.version == 1
    assert "sha256" in follower.skipped[3] and "dim8.rows.npy" in follower.skipped[3]
    # 2 is now older than a complete version: an abandoned publish, reported as such
    assert "no manifest" in follower.skipped[2]
    # a delta on top of the refused one is refused too; a bad manifest is refused
    publish(tmp_path, 4, random_tables(rng, 10), base=3)
    (publish(tmp_path, 5, random_tables(rng, 10), base=1) / "manifest.json").write_text("{not json")
    assert follower.poll() is None and follower.current.version == 1
    assert "version 3" in follower.skipped[4] and "not a valid bundle manifest" in follower.skipped[5]
    assert follower.behind == 0
    # the next full snapshot recovers
    publish(tmp_path, 6, random_tables(rng, 50))
    assert follower.poll().version == 6 and follower.current.manifest.rows == {4: 50, 8: 50}


def test_a_follower_jumps_to_the_newest_version_it_can_reach(tmp_path):
    rng = np.random.default_rng(3)
    publish(tmp_path, 1, random_tables(rng, 100))
    for v in (2, 3):
        publish(tmp_path, v, random_tables(rng, 10), base=v - 1)
    follower = Follower(tmp_path)
    assert follower.poll().version == 3 and follower.passed_over == [1, 2]
    publish(tmp_path, 4, random_tables(rng, 100))
    publish(tmp_path, 5, random_tables(rng, 10), base=4)
    compact(tmp_path, keep=1)  # 1..3 go: the follower's base is gone, it reloads from 4
    assert [v.version for v in list_versions(tmp_path)[0]] == [4, 5]
    assert follower.poll().version == 5 and follower.passed_over == [4]
    publish(tmp_path, 6, random_tables(rng, 10), base=5)
    assert follower.poll().version == 6 and follower.passed_over == []


def test_compaction_keeps_the_newest_full_its_deltas_keep_and_their_chains(tmp_path):
    rng = np.random.default_rng(4)
    # full every 3: 1F 2 3 4F 5 6 7F 8 ; plus an abandoned 9 (no manifest) and a newer one being written (11)
    for v in range(1, 9):
        publish(tmp_path, v, random_tables(rng, 5), base=None if v % 3 == 1 else v - 1)
    publish(tmp_path, 9, random_tables(rng, 5), base=8, manifest=False)
    publish(tmp_path, 10, random_tables(rng, 5), base=8)
    publish(tmp_path, 11, random_tables(rng, 5), base=10, manifest=False)
    versions, _ = list_versions(tmp_path)
    assert kept_versions(versions, keep=1) == {7, 8, 10}
    assert kept_versions(versions, keep=5) == {4, 5, 6, 7, 8, 10}  # 5 and 6 need 4
    assert chain_to({v.version: v for v in versions}, 10, current=7)[0].version == 8
    removed = compact(tmp_path, keep=5)
    assert removed == [1, 2, 3, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"v{n:08d}" for n in (4, 5, 6, 7, 8, 10, 11)]
    assert newest_version_number(tmp_path) == 11
    compact(tmp_path, keep=1)
    assert [v.version for v in list_versions(tmp_path)[0]] == [7, 8, 10]
    assert (tmp_path / "v00000011").exists()  # newer than every complete version: being written


def test_a_version_directory_naming_another_version_is_refused(tmp_path):
    rng = np.random.default_rng(5)
    path = publish(tmp_path, 1, random_tables(rng, 5))
    m = json.loads((path / "manifest.json").read_text())
    m["version"] = 7
    (path / "manifest.json").write_text(json.dumps(m))
    versions, other = list_versions(tmp_path)
    assert versions == [] and "names version 7" in other[1]


def test_array_shard_tables_look_up_like_mapped_ones():
    table = EmbeddingTable([ArrayShardTable({4: np.array([2, 9], np.uint64)},
                                            {4: np.ones((2, 4), np.float32)})])
    assert table.lookup(4, np.array([9, 3], np.uint64)).sum(axis=1).tolist() == [4.0, 0.0]
    with pytest.raises(ValueError):
        merge_tables(table, EmbeddingTable([]), [4])
