"""`hybridrec export`: a job checkpoint (or a run's newest) becomes a bundle; bad sources exit 2 naming the file."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from hybridrec.core.layouts import checkpoints
from hybridrec.core.layouts.bundle import load_dense, open_bundle
from hybridrec.core.layouts.checkpoints import JobManifest
from hybridrec.app.cli import app
from hybridrec.core.config import dump_config, from_dict
from hybridrec.core.model.models import FeatureInfo, build_model
from hybridrec.core.wire.sharding import shard_of
from services.embedding_ps.checkpoint import dump_shard
from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig
from services.embedding_ps.store import EmbeddingStore, StoreConfig

FEATURES = [{"name": "C1", "group": 0, "dim": 8}, {"name": "C2", "group": 1, "dim": 4},
            {"name": "C3", "group": 2, "dim": 8}]
NUM_SHARDS = 2


def _config():
    return from_dict({"data": {"train": ["t.tsv"]}, "features": FEATURES, "num_dense": 3,
                      "model": {"path": "hybridrec.models:DNN", "kwargs": {"hidden": [8]}},
                      "training": {"precision": "bf16"},
                      "cluster": {"ps": ["127.0.0.1:0"] * NUM_SHARDS}})


@pytest.fixture
def run_dir(tmp_path):
    return make_checkpoint(tmp_path)


def make_checkpoint(tmp_path):
    """A run directory with one complete checkpoint at step 9 (2 PS shards, adagrad state in the dumps):
    (run dir, checkpoint dir, dense state_dict, {(width, id): trained row})."""
    config = _config()
    ckpt = checkpoints.step_dir(tmp_path / "run" / "checkpoints", 9)
    ckpt.mkdir(parents=True)
    dump_config(config, ckpt / "config.yaml")
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features], 3,
                        config.model.kwargs)
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}}, ckpt / "dense.pt")
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 1 << 50, 3000, dtype=np.uint64))
    truth = {}
    for shard in range(NUM_SHARDS):
        mine = keys[shard_of(keys, NUM_SHARDS) == shard]
        ps = PSConfig(capacity=10_000, num_stripes=2)
        stores = {d: EmbeddingStore.open(tmp_path / "shm" / f"{shard}-{d}", StoreConfig(
            dim=d, optimizer=EmbeddingOptimizerConfig(name="adagrad", lr=0.1), ps=ps, seed=1))
            for d in (4, 8)}
        for d, store in stores.items():
            store.lookup(mine, train=True)
            store.update(mine, rng.standard_normal((mine.size, d)).astype(np.float32))
            k, v = store.items()
            truth.update({(d, int(key)): row[:d].copy() for key, row in zip(k, v)})
        dump_shard(stores, ckpt, shard=shard, num_shards=NUM_SHARDS, step=9)
        for store in stores.values():
            store.close()
    checkpoints.write_manifest(ckpt, JobManifest(step=9, seq=18, position=[0, 0, 1, 1], num_nn_workers=2,
                                                 num_ps=NUM_SHARDS))
    return tmp_path / "run", ckpt, model.state_dict(), truth


def _export(*args):
    return CliRunner().invoke(app, ["export", *map(str, args)])


@pytest.mark.parametrize("which", ["run", "root", "checkpoint"])
def test_export_writes_the_trained_rows_and_weights(tmp_path, run_dir, which):
    """SOURCE: a run dir, a checkpoint root holding step-* dirs (checkpoint.dir, e.g. compose's /checkpoints),
    or one checkpoint."""
    run, ckpt, weights, truth = run_dir
    source = {"run": run, "root": ckpt.parent, "checkpoint": ckpt}[which]
    result = _export(source, "--out", tmp_path / "b")
    assert f"from {ckpt} " in result.output
    assert result.exit_code == 0, result.output
    manifest, table = open_bundle(tmp_path / "b")
    assert manifest.step == 9 and manifest.num_shards == NUM_SHARDS and manifest.precision == "bf16"
    assert [f.name for f in manifest.features] == ["C1", "C2", "C3"] and manifest.num_dense == 3
    assert manifest.model.kwargs == {"hidden": [8]}
    assert manifest.rows == {d: sum(1 for (w, _) in truth if w == d) for d in (4, 8)}
    for dim in (4, 8):
        ids = np.array([k for (w, k) in truth if w == dim][:500] + [12345], np.uint64)
        got = table.lookup(dim, ids)
        np.testing.assert_array_equal(got[:-1], np.stack([truth[(dim, int(i))] for i in ids[:-1]]))
        assert not got[-1].any()
        for shard, sub in enumerate(table.shards):  # the checkpoint's sharding is kept
            assert np.all(shard_of(np.asarray(sub.keys[dim]), NUM_SHARDS) == shard)
    dense = load_dense(tmp_path / "b")
    assert dense.keys() == weights.keys() and all(torch.equal(dense[k], weights[k]) for k in weights)
    inspected = _export("--inspect", tmp_path / "b")
    assert inspected.exit_code == 0 and json.loads(inspected.output)["step"] == 9


def test_bad_sources_and_outputs_exit_2_naming_the_file(tmp_path, run_dir):
    run, ckpt, _, _ = run_dir
    (tmp_path / "empty").mkdir()
    result = _export(tmp_path / "empty", "--out", tmp_path / "b")
    assert result.exit_code == 2 and "no complete checkpoint" in result.output and "empty" in result.output
    result = _export(tmp_path / "nowhere", "--out", tmp_path / "b")
    assert result.exit_code == 2 and "nowhere" in result.output
    (tmp_path / "exists").mkdir()
    result = _export(run, "--out", tmp_path / "exists")
    assert result.exit_code == 2 and "already exists" in result.output
    (tmp_path / "file").write_text("")
    result = _export(run, "--out", tmp_path / "file" / "b")  # an --out that cannot be created (OSError)
    assert result.exit_code == 2 and str(tmp_path / "file") in result.output and "Traceback" not in result.output
    (ckpt / "manifest.json").rename(tmp_path / "manifest.json")  # a half-written checkpoint
    result = _export(ckpt, "--out", tmp_path / "b")
    assert result.exit_code == 2 and "half-written" in result.output and str(ckpt) in result.output
    result = _export(run, "--out", tmp_path / "b")  # ... is not a run's newest complete checkpoint either
    assert result.exit_code == 2 and "no complete checkpoint" in result.output
    (tmp_path / "manifest.json").rename(ckpt / "manifest.json")
    values = ckpt / "ps" / "shard-00001-of-00002" / "dim8.00000.values.npy"
    with open(values, "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\xff")
    result = _export(run, "--out", tmp_path / "b")
    assert result.exit_code == 2 and str(values) in result.output and "sha256" in result.output
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.tmp-*"))


def test_inspect_refuses_a_corrupt_bundle(tmp_path, run_dir):
    assert _export(run_dir[0], "--out", tmp_path / "b").exit_code == 0
    dense = tmp_path / "b" / "dense.pt"
    data = bytearray(dense.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dense.write_bytes(bytes(data))
    result = _export("--inspect", tmp_path / "b")
    assert result.exit_code == 2 and str(dense) in result.output
