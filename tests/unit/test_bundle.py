"""Model bundles: write, verify, look rows up (sharded, memory-mapped), refuse tampered ones naming the file."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridrec.core.layouts.bundle import (BundleError, BundleManifest, BundleWriter, load_dense, open_bundle,
                              quantize_rows,
                              read_manifest, table_files)
from hybridrec.core.config import FeatureConfig, ModelConfig
from hybridrec.core.wire.sharding import shard_of

FEATURES = [FeatureConfig(name="C1", group=0, dim=8), FeatureConfig(name="C2", group=1, dim=4)]


def _write(path, num_shards=2, rows_per_dim=1000, seed=0, quantization=None):
    """A bundle (`quantization` "int8": of int8 tables) and, per width, {key: the float32 row written}."""
    from hybridrec.core.layouts.bundle import FORMAT_VERSION, QUANTIZED_FORMAT_VERSION

    rng = np.random.default_rng(seed)
    manifest = BundleManifest(features=FEATURES, num_dense=3, model=ModelConfig(), num_shards=num_shards, step=7,
                              quantization=quantization,
                              format_version=QUANTIZED_FORMAT_VERSION if quantization else FORMAT_VERSION)
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


def test_an_int8_bundle_serves_each_row_within_half_a_step_in_dim_plus_2_bytes(tmp_path):
    from hybridrec.core.layouts.bundle import ShardTable, scales_file

    truth = _write(tmp_path / "q", rows_per_dim=2000, seed=3, quantization="int8")
    manifest, table = open_bundle(tmp_path / "q")
    assert manifest.quantization == "int8" and manifest.format_version == 2
    shards = [ShardTable(tmp_path / "q", manifest, s) for s in range(2)]
    for dim, by_key in truth.items():
        keys, rows = np.array(list(by_key), np.uint64), np.stack(list(by_key.values()))
        got = table.lookup(dim, np.concatenate([keys, [1 << 41]]).astype(np.uint64))
        step = np.abs(rows).max(axis=1, keepdims=True) / 127
        assert (np.abs(got[:-1] - rows) <= step * 0.5 * (1 + 2 ** -10) + 1e-12).all() and not got[-1].any()
        for s, shard in enumerate(shards):  # the numpy path (read-only PS shards) answers the compiled one's rows
            mine = keys[shard_of(keys, 2) == s]
            np.testing.assert_array_equal(shard.lookup(dim, mine), table.lookup(dim, mine))
    files = manifest.files
    int8 = sum(files[r].bytes for s in range(2) for r in (table_files(s, 2, 8)[1], scales_file(s, 2, 8)))
    assert 2000 * (8 + 2) <= int8 <= 2000 * (8 + 2) + 4 * 128  # (dim + 2) bytes a row, .npy headers aside:
    # 18 instead of 64 at width 16 (3.56x), 10 instead of 32 here
    zeros = _write(tmp_path / "z", rows_per_dim=10, quantization="int8")  # a row of zeros: scale 0, read as zeros
    assert zeros and not quantize_rows(np.zeros((2, 4), np.float32))[1].any()


def test_an_int8_bundle_is_refused_by_version_where_it_cannot_be_read(tmp_path):
    _write(tmp_path / "q", quantization="int8")
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    manifest["format_version"] = 1  # as a build before quantized tables would have to read it
    (tmp_path / "q" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="version 1 \\(int8 tables\\); this build reads .*version 2 with int8"):
        read_manifest(tmp_path / "q")
    _write(tmp_path / "f")
    assert json.loads((tmp_path / "f" / "manifest.json").read_text())["format_version"] == 1  # float32: as before
