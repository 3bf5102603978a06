"""Live versions end to end: `hybridrec run` with publish.interval_steps=10 writes versions whose merged table
equals the PS at the end of training (a job checkpoint taken at the last step, after every rank drained its
updates), and whose last dense weights are the trained model's."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from hybridrec.versions import Follower, list_versions, table_arrays
from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration

STEPS = 50


def _checkpoint_rows(step_dir, dim):
    keys, rows = [], []
    for shard in sorted((step_dir / "ps").iterdir()):
        k = np.load(shard / f"dim{dim}.keys.npy")
        v = np.load(shard / f"dim{dim}.values.npy")
        keys.append(k)
        rows.append(v[:, :dim])
    keys, rows = np.concatenate(keys), np.concatenate(rows)
    order = np.argsort(keys)
    return keys[order], rows[order]


def test_published_versions_merge_to_the_final_ps_state(tmp_path, small_data):
    config = write_config(tmp_path / "config.yaml", small_data,
                          training={"batch_size": 512, "max_steps": STEPS},
                          ps={"capacity": 1_000_000},
                          checkpoint={"interval_steps": STEPS, "keep": 1},
                          publish={"interval_steps": 10, "full_every": 3, "keep": 2})
    run_dir = tmp_path / "run"
    result = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    publish = summary["publish"]
    assert publish["failed"] == 0 and publish["published"] >= 4, publish
    assert publish["published"] + publish["skipped"] >= STEPS // 10
    assert publish["last_step"] == STEPS and publish["full"] >= 2

    versions, other = list_versions(run_dir / "versions")
    assert not other, other
    numbers = [v.version for v in versions]
    assert numbers[-1] == publish["last_version"]
    # compaction kept the newest full snapshot, the deltas after it and the 2 newest, with their chains
    fulls = [v.version for v in versions if v.full]
    assert fulls and all(n >= fulls[0] for n in numbers)
    assert all(v.manifest.base_version in numbers for v in versions if not v.full)

    snapshot = Follower(run_dir / "versions").poll()
    assert snapshot.version == numbers[-1] and snapshot.step == STEPS
    step_dir = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    for dim in snapshot.manifest.widths:
        keys, rows = table_arrays(snapshot.table, dim)
        want_keys, want_rows = _checkpoint_rows(step_dir, dim)
        np.testing.assert_array_equal(keys, want_keys)
        np.testing.assert_array_equal(rows, want_rows)
    trained = torch.load(run_dir / "dense_model.pt", weights_only=True)
    assert trained.keys() == snapshot.dense_state.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, snapshot.dense_state[name]), name
