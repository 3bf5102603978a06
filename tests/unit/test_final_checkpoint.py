"""Final checkpoints: `hybridrec run` always has a checkpoint dir; only interval checkpoints are resumed from."""
from __future__ import annotations

import asyncio

import pytest

from hybridrec.core.layouts import checkpoints
from hybridrec.core.layouts.checkpoints import JobManifest
from hybridrec.core.config import from_dict
from hybridrec.app.run.launcher import resolve


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
    # a final checkpoint alone (no interval of either kind)
    assert checkpoints.resume_from(_config(dir=str(tmp_path), interval_s=None).checkpoint) is None
    found = checkpoints.resume_from(_config(dir=str(tmp_path), interval_steps=5).checkpoint)
    assert found is not None and found[1].step == 7
    found = checkpoints.resume_from(_config(dir=str(tmp_path)).checkpoint)  # the default time interval
    assert found is not None and found[1].step == 7
    assert checkpoints.resume_from(_config(dir=str(tmp_path), interval_steps=5, resume=False).checkpoint) is None
    assert checkpoints.resume_from(_config(interval_steps=5).checkpoint) is None


@pytest.mark.parametrize("mode, interval, restored, written", [
    ("hybrid", None, None, True),
    ("hybrid", 5, None, False),  # the interval checkpoint of step 10 is the final state: DDP replicas are identical
    ("async", 5, None, True),  # ... not in async mode: the replicas were averaged after it
    ("async", 5, 10, False),  # resumed from step 10: every rank loaded it, nothing trained since
    ("hybrid", 3, None, True),
])
def test_final_checkpoint_is_written_unless_one_of_the_last_step_holds_the_final_state(tmp_path, mode, interval,
                                                                                       restored, written):
    from services.nn_worker.checkpoint import Checkpointer

    config = from_dict({"data": {"train": ["t.tsv"]}, "training": {"mode": mode},
                        "checkpoint": {"dir": str(tmp_path), "interval_steps": interval}})
    checkpointer = Checkpointer(config, 0, 2)
    saved = []

    async def save(trainer, step, last, **_):
        ((seq, position),) = last  # one data loader's stream
        saved.append((step, seq, position))
        checkpointer.last_saved = step

    checkpointer.save = save
    if interval and 10 % interval == 0:
        asyncio.run(save(None, 10, [(19, (0, 0, 5, 5))]))
        saved.clear()
    checkpointer.restored_step = restored
    asyncio.run(checkpointer.finish(None, 10, [(19, (0, 0, 5, 5))]))
    assert saved == ([(10, 19, (0, 0, 5, 5))] if written else [])
    assert checkpointer.final_path == checkpoints.step_dir(tmp_path, 10)
    assert (checkpointer.final_s is not None) == written


def test_no_final_checkpoint_when_off_or_without_a_dir(tmp_path):
    from services.nn_worker.checkpoint import Checkpointer

    for checkpoint in ({"dir": str(tmp_path), "final": False}, {}):
        config = from_dict({"data": {"train": ["t.tsv"]}, "checkpoint": checkpoint})
        checkpointer = Checkpointer(config, 0, 1)
        asyncio.run(checkpointer.finish(None, 3, [(5, (0, 0, 1, 1))]))
        assert checkpointer.final_path is None and not list(tmp_path.iterdir())
