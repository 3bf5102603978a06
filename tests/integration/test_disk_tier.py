"""The disk tier end to end (docs/architecture.md#disk-tier): `hybridrec run` with a PS whose memory holds a
quarter of the table, over a disk tier, trains to the end, loses nothing, and leaves exactly the rows of the same
job whose table fits in memory (one NN worker, sync: a deterministic job)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration

STEPS = 30
BATCH = 1024


def _run(tmp_path: Path, data: Path, name: str, ps: dict) -> tuple[dict, Path]:
    config = write_config(tmp_path / f"{name}.yaml", data, ps=ps,
                          training={"batch_size": BATCH, "max_steps": STEPS, "mode": "sync", "staleness": 0},
                          cluster={"ps": ["127.0.0.1:0", "127.0.0.1:0"], "nn_workers": ["127.0.0.1:0"],
                                   "embedding_workers": ["127.0.0.1:0"], "dataloader": ["127.0.0.1:0"]})
    run_dir = tmp_path / name
    result = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text()), run_dir


def _rows(summary: dict) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every row of the final checkpoint (the PS at the end of training, both tiers), per width, sorted by key."""
    from services.embedding_ps.checkpoint import read_embeddings

    _, tables = read_embeddings(Path(summary["checkpoint"]))
    out = {}
    for dim in sorted({d for _, d, _, _ in tables}):
        keys = np.concatenate([np.asarray(k) for _, d, k, _ in tables if d == dim])
        rows = np.concatenate([np.asarray(r) for _, d, _, r in tables if d == dim])
        order = np.argsort(keys)
        out[dim] = keys[order], rows[order]
    return out


def test_a_table_four_times_the_memory_trains_as_if_it_fitted(tmp_path, small_data):
    whole, _ = _run(tmp_path, small_data, "memory", {"capacity": 100_000, "num_stripes": 4})
    table = whole["ps_rows"] // 2  # rows per shard (two shards)
    assert table > 4 * 64, whole["ps_rows"]
    quarter = table // 4
    tiered, run_dir = _run(tmp_path, small_data, "tiered", {
        "capacity": quarter, "num_stripes": 4, "tier": {"dir": str(tmp_path / "disk"), "capacity": 100_000}})

    assert tiered["steps"] == whole["steps"] == STEPS
    for summary in (whole, tiered):
        assert summary["lost_updates"] == 0 and summary["skipped_batches"] == 0, summary
        assert all(t["dropped_gradients"] == 0 for t in (summary["lifecycle"] or {}).values()), summary["lifecycle"]
    tier = tiered["disk_tier"]
    assert whole["disk_tier"] is None
    assert tier["overflows"] == 0 and tier["writebacks"] > 0 and tier["fills"] > 0, tier
    assert tier["memory_rows"] <= 2 * quarter * len(_rows(whole)) and tier["disk_rows"] >= tier["writebacks"] // 10, tier
    assert 0 < tier["memory_hit_rate"] < 1, tier

    want, got = _rows(whole), _rows(tiered)
    assert want.keys() == got.keys()
    for dim in want:
        np.testing.assert_array_equal(got[dim][0], want[dim][0])
        np.testing.assert_array_equal(got[dim][1], want[dim][1])
    assert tiered["auc"] == pytest.approx(whole["auc"], abs=1e-9)
    assert not (tmp_path / "disk").exists() or not any((tmp_path / "disk").iterdir()), "the run left its disk tier"
