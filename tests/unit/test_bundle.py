"""Model bundles: write, verify, look rows up (sharded, memory-mapped), refuse tampered ones naming the file."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridrec.bundle import (BundleError, BundleManifest, BundleWriter, load_dense, open_bundle, read_manifest,
                              table_files)
from hybridrec.config import FeatureConfig, ModelConfig
from hybridrec.sharding import shard_of

FEATURES = [FeatureConfig(name="C1", group=0, dim=8), FeatureConfig(name="C2", group=1, dim=4)]


def _write(path, num_shards=2, rows_per_dim=1000, seed=0):
    rng = np.random.default_rng(seed)
    manifest = BundleManifest(features=FEATURES, num_dense=3, model=ModelConfig(), num_shards=num_shards, step=7)
    writer = BundleWriter(path, manifest)
    writer.add_dense({"w": torch.arange(6.0).reshape(2, 3)})
    truth = {}
    for dim in (8, 4):
        keys = rng.choice(1 << 40, size=rows_per_dim, replace=False).astype(np.uint64)
        rows = rng.standard_normal((rows_per_dim, dim)).astype(np.float32)
        truth[dim] = dict(zip(keys.tolist(), rows))
        owner = shard_of(keys, num_shards)
        for shard in range(num_shards):
            writer.add_table(shard, dim, keys[owner == shard], rows[owner == shard])
    writer.commit()
    return truth


def test_lookup_matches_rows_and_reads_zeros_for_unknown_ids(tmp_path):
    truth = _write(tmp_path / "b")
    manifest, table = open_bundle(tmp_path / "b")
    assert manifest.step == 7 and manifest.rows == {8: 1000, 4: 1000}
    for dim, rows in truth.items():
        known = np.array(list(rows)[:300], np.uint64)
        unknown = np.array([1 << 41, (1 << 41) + 5], np.uint64)
        ids = np.concatenate([unknown[:1], known, unknown[1:]])
        got = table.lookup(dim, ids)
        np.testing.assert_array_equal(got[1:-1], np.stack([rows[k] for k in known.tolist()]))
        assert not got[0].any() and not got[-1].any()
    assert torch.equal(load_dense(tmp_path / "b")["w"], torch.arange(6.0).reshape(2, 3))


def test_tampered_or_partial_bundles_are_refused_naming_the_file(tmp_path):
    _write(tmp_path / "b")
    keys_rel, rows_rel = table_files(1, 2, 4)
    with open(tmp_path / "b" / rows_rel, "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x7f")
    with pytest.raises(BundleError, match=rows_rel.split("/")[-1]):
        open_bundle(tmp_path / "b")
    (tmp_path / "b" / keys_rel).unlink()
    with pytest.raises(BundleError, match="missing"):
        open_bundle(tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["format_version"] = 99
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="version 99"):
        read_manifest(tmp_path / "b")
    with pytest.raises(BundleError, match="no manifest"):
        read_manifest(tmp_path)


def test_an_aborted_writer_leaves_no_bundle(tmp_path):
    writer = BundleWriter(tmp_path / "b", BundleManifest(features=FEATURES, num_dense=3, model=ModelConfig(),
                                                         num_shards=1))
    writer.add_table(0, 8, np.arange(3, dtype=np.uint64), np.ones((3, 8), np.float32))
    writer.abort()
    assert not (tmp_path / "b").exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(BundleError, match="already exists"):
        _write(tmp_path / "c")
        _write(tmp_path / "c")
