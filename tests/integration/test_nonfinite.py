"""A model that makes a NaN loss at a chosen step, on one of two NN workers, in hybrid and sync modes: the step
updates nothing anywhere (`training.on_nonfinite: skip`, counted in the summary), every checkpoint's dense model
and every PS row stay finite, and the run trains on; with `stop` the run ends naming the step and the rank
before a checkpoint is written after it."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.core.layouts import checkpoints
from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration

NAN_AT = 6


def _config(tmp_path: Path, data: Path, mode: str, on_nonfinite: str = "skip", receiver: bool = False) -> Path:
    return write_config(tmp_path / "config.yaml", data,
                        model={"path": "tests.integration.nan_model:NaNAtStep",
                               "kwargs": {"hidden": [64, 32], "step": NAN_AT, "rank": 1}},
                        training={"mode": mode, "on_nonfinite": on_nonfinite, "batch_size": 2048,
                                  "receiver": receiver},
                        checkpoint={"dir": str(tmp_path / "ckpt"), "interval_steps": 4, "interval_s": None,
                                    "keep": 10},
                        cluster={"nn_workers": ["127.0.0.1:0"] * 2})


def _finite_checkpoint(path: Path) -> None:
    from services.embedding_ps.checkpoint import read_embeddings

    dense = torch.load(path / checkpoints.DENSE, weights_only=True)
    tensors = [t for t in _tensors(dense) if t.is_floating_point()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors), path
    _, tables = read_embeddings(path / checkpoints.PS)
    assert tables and all(np.isfinite(np.asarray(rows)).all() for _, _, _, rows in tables), path


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


@pytest.mark.parametrize("mode, receiver", [("hybrid", False), ("sync", False), ("hybrid", True)])
def test_a_nan_loss_on_one_rank_updates_nothing_and_training_goes_on(tmp_path, small_data, mode, receiver):
    """(With `training.receiver` the compute thread writes the discard into the receiver's slot itself.)"""
    run_dir = tmp_path / "run"
    out = subprocess.run(HYBRIDREC + ["run", str(_config(tmp_path, small_data, mode, receiver=receiver)), "--run-dir",
                                      str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nonfinite_steps"] == 1 and np.isfinite(summary["mean_train_loss"]), summary
    assert summary["lost_updates"] == 0 and summary["auc"] > 0.6, summary  # as without the NaN (test_modes)
    logged = [json.loads(line) for rank in (0, 1) for line in (run_dir / "logs" / f"nn_worker-{rank}.log")
              .read_text().splitlines() if '"nonfinite_step"' in line]
    assert sorted((r["rank"], r["step"]) for r in logged) == [(0, NAN_AT), (1, NAN_AT)]  # both ranks skipped it
    written = checkpoints.complete(tmp_path / "ckpt")
    assert len(written) >= 3 and Path(summary["checkpoint"]) in written
    for path in written:
        _finite_checkpoint(path)


def test_on_nonfinite_stop_ends_the_run_naming_step_and_rank_before_a_checkpoint(tmp_path, small_data):
    run_dir = tmp_path / "run"
    out = subprocess.run(HYBRIDREC + ["run", str(_config(tmp_path, small_data, "hybrid", "stop")), "--run-dir",
                                      str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert f"training.on_nonfinite: stop: step {NAN_AT} on NN worker rank" in out.stderr, out.stderr[-3000:]
    steps = [checkpoints.read_manifest(p).step for p in checkpoints.complete(tmp_path / "ckpt")]
    assert steps == [4], steps  # the one before the step; none after it


def _with_long_integers(data: Path, out: Path, lines_at: tuple[int, ...]) -> Path:
    """The small training file with a 309-digit integer in I2 of each of `lines_at` (0-based): past the first
    rows that check reads, so only the data loader meets them."""
    lines = (data / "train.tsv").read_bytes().splitlines(keepends=True)
    for at in lines_at:
        fields = lines[at].split(b"\t")
        fields[2] = b"3" * 309
        lines[at] = b"\t".join(fields)
    out.write_bytes(b"".join(lines))
    return out


def _data_config(path: Path, data: Path, **keys) -> Path:
    import yaml

    tree = yaml.safe_load(write_config(path, data).read_text())
    tree["data"].update(keys)
    path.write_text(yaml.safe_dump(tree))
    return path


def test_non_finite_data_mid_file_is_skipped_and_counted_per_file_or_stops_naming_file_and_line(tmp_path,
                                                                                                 small_data):
    path = _with_long_integers(small_data, tmp_path / "long.tsv", (20_000, 45_001))
    config = _data_config(tmp_path / "skip.yaml", small_data, train=[str(path)], non_finite="skip")
    out = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(tmp_path / "skip")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert summary["samples"] == 60_000 - 2 and summary["data"]["train"]["non_finite_rows"] == 2, summary["data"]
    assert summary["data"]["train"]["non_finite_by_file"] == {str(path): 2}
    config = _data_config(tmp_path / "error.yaml", small_data, train=[str(path)])
    out = subprocess.run(HYBRIDREC + ["check", str(config)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr  # the first rows are fine: check cannot know
    out = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(tmp_path / "error")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert f"{path}:20001: column I2 is not finite: an integer of 309 digits" in out.stderr, out.stderr[-3000:]
