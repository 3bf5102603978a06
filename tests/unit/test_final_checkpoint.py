"""Final checkpoints: `hybridrec run` always has a checkpoint dir; only interval checkpoints are resumed from."""
from __future__ import annotations

from hybridrec import checkpoints
from hybridrec.checkpoints import JobManifest
from hybridrec.config import from_dict
from hybridrec.launcher import resolve


def _config(**checkpoint):
    return from_dict({"data": {"train": ["t.tsv"]}, "checkpoint": checkpoint})


def test_final_is_on_by_default_and_run_always_sets_a_checkpoint_dir(tmp_path):
    assert _config().checkpoint.final is True
    resolved = resolve(_config(), tmp_path / "run")
    assert resolved.checkpoint.dir == str(tmp_path / "run" / "checkpoints")
    assert resolved.checkpoint.interval_steps is None  # interval checkpoints stay off
    mine = resolve(_config(dir=str(tmp_path / "mine"), interval_steps=5), tmp_path / "run")
    assert mine.checkpoint.dir == str(tmp_path / "mine") and mine.checkpoint.interval_steps == 5


def test_only_interval_checkpoints_are_resumed_from(tmp_path):
    step = checkpoints.step_dir(tmp_path, 7)
    step.mkdir()
    checkpoints.write_manifest(step, JobManifest(step=7, seq=14, position=[0, 0, 100, 14]))
    assert checkpoints.resume_from(_config(dir=str(tmp_path)).checkpoint) is None  # a final checkpoint alone
    found = checkpoints.resume_from(_config(dir=str(tmp_path), interval_steps=5).checkpoint)
    assert found is not None and found[1].step == 7
    assert checkpoints.resume_from(_config(dir=str(tmp_path), interval_steps=5, resume=False).checkpoint) is None
    assert checkpoints.resume_from(_config(interval_steps=5).checkpoint) is None
