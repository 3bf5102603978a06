"""A job whose newest checkpoint's dense.pt was cut short (a power loss before its pages reached the disk)
resumes from the checkpoint before it, naming the one it skipped (hybridrec/core/layouts/checkpoints.py `latest`)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from hybridrec.core.layouts import checkpoints
from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration


def _run(tmp_path, data, max_steps: int, name: str) -> dict:
    config = write_config(tmp_path / f"{name}.yaml", data, training={"max_steps": max_steps},
                          checkpoint={"dir": str(tmp_path / "ckpt"), "interval_steps": 4, "interval_s": None,
                                      "keep": 10})
    run_dir = tmp_path / name
    out = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_a_cut_short_dense_state_is_skipped_and_the_job_resumes_from_the_checkpoint_before(tmp_path, small_data):
    first = _run(tmp_path, small_data, 9, "first")
    steps = [checkpoints.read_manifest(p).step for p in checkpoints.complete(tmp_path / "ckpt")]
    assert steps == [9, 8, 4], steps
    assert all(checkpoints.read_manifest(p).files for p in checkpoints.complete(tmp_path / "ckpt"))
    newest = checkpoints.step_dir(tmp_path / "ckpt", 9)
    os.truncate(newest / checkpoints.DENSE, (newest / checkpoints.DENSE).stat().st_size // 3)
    second = _run(tmp_path, small_data, 12, "second")
    assert first["steps"] == 9 and second["steps"] == 12, (first["steps"], second["steps"])
    log = [json.loads(line) for line in (tmp_path / "second" / "logs" / "nn_worker-0.log").read_text().splitlines()
           if line.startswith("{")]
    restored = [r for r in log if r["event"] == "checkpoint_restored"]
    skipped = [r for r in log if r["event"] == "checkpoint_skipped"]
    assert [r["step"] for r in restored] == [8], restored
    assert skipped and skipped[0]["checkpoint"] == str(newest) and "cut short" in skipped[0]["why"], skipped
