"""A PS shard that comes back without its store in a job that has trained it (services/embedding_ps/lives.py):
it restores its part of the newest checkpoint before it would serve, never an empty table, and records the loss
with what the lost life had applied at that checkpoint. Real stores, real checkpoint files, the servicer called
in-process."""
from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor

from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from hybridrec.core.layouts import checkpoints
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import Config
from hybridrec.core.wire.frames import Applied, PSUpdate
from hybridrec.core.wire.ids import GROUP_SHIFT
from hybridrec.core.wire.proto import pb
from services.embedding_ps import lives
from services.embedding_ps.server import EmbeddingPSServicer, open_shard, shard_dir

DIM = 4


def _config(tmp_path, job: str | None = "job-a", full_every: int = 8) -> Config:
    return Config.model_validate({
        "data": {"train": ["unused"]},
        "features": [{"name": "f", "group": 1, "dim": DIM}],
        "cluster": {"ps": ["127.0.0.1:1"]},
        "ps": {"shm_dir": str(tmp_path / "shm"), "capacity": 4096, "num_stripes": 2},
        "optimizer": {"embedding": {"name": "sgd", "lr": 1.0}},
        "training": {"compression": {"fp16": False}},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "job_id": job, "full_every": full_every},
    })


class Shard:
    """Shard 0 opened as `serve` opens it, with its servicer."""

    def __init__(self, config: Config):
        self.stores, self.applied, self.losses = open_shard(config, 0)
        self.executor = ThreadPoolExecutor(1)
        self.servicer = EmbeddingPSServicer(self.stores, self.applied, 0, 1, ValueCodec(fp16=False), self.executor,
                                            checkpoint_root=config.checkpoint.dir, losses=self.losses,
                                            full_every=config.checkpoint.full_every)

    def update(self, uid: int, ids: np.ndarray) -> Applied:
        """A training lookup of `ids` (which gives them rows), then update `uid` of them."""
        self.stores[DIM].lookup(ids, train=True)
        frame = PSUpdate({DIM: ids}, {DIM: np.ones((ids.size, DIM), np.float32)}, uid).encode(ValueCodec(fp16=False))
        return Applied.decode(asyncio.run(self.servicer.Update(frame, None)))

    def rows(self) -> int:
        return int(self.stores[DIM].stats()["rows"])

    def close(self) -> None:
        self.executor.shutdown()
        for store in self.stores.values():
            store.close()
        self.applied.close()


def _ids(n: int, start: int = 1) -> np.ndarray:
    return np.array([(1 << GROUP_SHIFT) | v for v in range(start, start + n)], np.uint64)


def _checkpoint(shard: Shard, config: Config, step: int, base: int | None = None) -> pb.CheckpointReply:
    """A complete job checkpoint of this one-shard job at `step` (its dump may build on `base`'s): the shard's
    dump, then the manifest."""
    name = f"step-{step:08d}"
    reply = asyncio.run(shard.servicer.Checkpoint(pb.CheckpointRequest(name=name, step=step, base=base), None))
    checkpoints.write_manifest(Path(config.checkpoint.dir) / name, checkpoints.JobManifest(
        step=step, seq=0, position=[0, 0, 0, 0], chain=[s for s in reply.chain if s != step]))
    return reply


def test_a_lost_store_is_restored_from_the_newest_checkpoint_and_the_loss_recorded(tmp_path):
    config = _config(tmp_path)
    first = Shard(config)
    assert first.losses == [] and first.applied.created
    life = first.applied.life
    assert first.update(11, _ids(10)).lives == ((0, life),)  # every acknowledgement names the life
    assert first.update(12, _ids(10, 100)).lives == ((0, life),)
    _checkpoint(first, config, step=40)
    first.update(13, _ids(5, 200))  # applied after the checkpoint: lost with the store
    assert first.rows() == 25
    first.close()

    again = Shard(config)  # a process restart: the files are there, the same life, nothing restored
    assert again.applied.life == life and again.losses == [] and again.rows() == 25
    again.close()

    shutil.rmtree(shard_dir(config, 0))  # the host is lost
    restored = Shard(config)
    assert restored.applied.life != life
    assert restored.rows() == 20, "the checkpoint's rows, loaded before the shard would serve"
    [loss] = restored.losses
    assert (loss.life, loss.applied_at_checkpoint, loss.restored_step) == (life, 2, 40)
    recovery = restored.servicer.recovery()
    assert recovery.life == restored.applied.life
    assert [(x.shard, x.life, x.applied_at_checkpoint, x.restored_step) for x in recovery.losses] == \
        [(0, life, 2, 40)]
    assert restored.servicer.stats()["stores_lost_total"] == 1 and restored.servicer.stats()["restored_step"] == 40
    restored.close()
    recorded = lives.read(config.checkpoint.dir, 0, "job-a")
    assert [x.life for x in recorded.lives] == [life, recovery.life]


def test_with_no_checkpoint_yet_the_shard_starts_empty_and_everything_it_applied_is_lost(tmp_path):
    config = _config(tmp_path)
    first = Shard(config)
    life = first.applied.life
    first.update(11, _ids(10))
    first.close()
    shutil.rmtree(shard_dir(config, 0))
    second = Shard(config)
    assert second.rows() == 0
    [loss] = second.losses
    assert (loss.life, loss.applied_at_checkpoint, loss.restored_step) == (life, 0, -1)
    second.close()


def test_a_new_job_or_no_job_id_is_a_first_start_not_a_loss(tmp_path):
    first = Shard(_config(tmp_path, job="job-a"))
    first.update(11, _ids(3))
    first.close()
    shutil.rmtree(shard_dir(_config(tmp_path), 0))
    other_job = Shard(_config(tmp_path, job="job-b"))  # a new job in the same checkpoint directory
    assert other_job.losses == [] and other_job.rows() == 0
    other_job.close()
    shutil.rmtree(shard_dir(_config(tmp_path), 0))
    no_job = Shard(_config(tmp_path, job=None))
    assert no_job.losses == []
    no_job.close()


def test_a_partly_lost_shard_is_wiped_and_restored_whole(tmp_path):
    """The applied-update record survived but a store did not: nothing of the shard can be trusted."""
    config = _config(tmp_path)
    first = Shard(config)
    life = first.applied.life
    first.update(11, _ids(10))
    _checkpoint(first, config, step=7)
    first.close()
    shutil.rmtree(shard_dir(config, 0) / f"dim-{DIM}")
    second = Shard(config)
    assert second.applied.life != life and second.rows() == 10
    assert [(x.life, x.restored_step) for x in second.losses] == [(life, 7)]
    second.close()


def test_applied_frames_name_lives_and_refuse_malformed_ones():
    assert Applied.decode(Applied(3, ((0, 2**64 - 1), (1, 5))).encode()) == Applied(3, ((0, 2**64 - 1), (1, 5)))
    assert Applied.decode(Applied(4).encode()) == Applied(4)
    from hybridrec.core.wire import codec
    from hybridrec.core.wire.frames import FrameError

    for bad in ([[0]], [[0, -1]], "x", [[0, True]]):
        with pytest.raises(FrameError, match="lives"):
            Applied.decode(codec.encode(meta={"applied": 1, "lives": bad}))


def _two_checkpoints(config: Config) -> int:
    """Shard 0 trains 10 rows, checkpoint 7, 4 more, checkpoint 9, and loses its store; returns its life."""
    first = Shard(config)
    life = first.applied.life
    first.update(11, _ids(10))
    _checkpoint(first, config, step=7)
    first.update(12, _ids(4, 50))
    _checkpoint(first, config, step=9)
    first.close()
    shutil.rmtree(shard_dir(config, 0))
    return life


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_newest_whole_one_restored(tmp_path):
    config = _config(tmp_path)
    life = _two_checkpoints(config)
    damaged = next((Path(config.checkpoint.dir) / "step-00000009").rglob("*.values.npy"))
    damaged.write_bytes(b"not an array")
    with capture_logs() as logs:
        again = Shard(config)
    assert again.rows() == 10
    assert [(x.life, x.restored_step) for x in again.losses] == [(life, 7)]
    refused = [e for e in logs if e["event"] == "ps_checkpoint_refused"]
    assert len(refused) == 1 and refused[0]["error"].startswith(f"{damaged}: ")
    again.close()


def test_a_restore_that_failed_leaves_no_files_a_later_start_would_trust(tmp_path):
    """Every checkpoint is damaged: the shard refuses to start, naming the newest; once one is whole again, the
    next start restores it instead of serving the empty stores the failed attempt created."""
    config = _config(tmp_path)
    life = _two_checkpoints(config)
    root = Path(config.checkpoint.dir)
    next((root / "step-00000009").rglob("*.values.npy")).write_bytes(b"not an array")
    older = next((root / "step-00000007").rglob("*.values.npy"))
    older.rename(older.with_suffix(".away"))
    with pytest.raises(ValueError, match="step-00000009"):
        open_shard(config, 0)
    older.with_suffix(".away").rename(older)
    again = Shard(config)
    assert again.rows() == 10
    assert [(x.life, x.restored_step) for x in again.losses] == [(life, 7)]
    again.close()


def test_a_lost_store_is_restored_from_a_chain_of_deltas_and_what_came_after_counted(tmp_path):
    """Incremental checkpoints (checkpoint.full_every 4): the store lost after checkpoint 3, a delta on a delta
    on a full dump, comes back with every row of that chain bit for bit, and what it applied after counts."""
    config = _config(tmp_path, full_every=4)
    first = Shard(config)
    life = first.applied.life
    first.update(1, _ids(10))
    assert list(_checkpoint(first, config, step=1).chain) == [1]
    first.update(2, _ids(5, 8))
    assert list(_checkpoint(first, config, step=2, base=1).chain) == [1, 2]
    first.update(3, _ids(3, 30))
    assert list(_checkpoint(first, config, step=3, base=2).chain) == [1, 2, 3]
    keys, values = first.stores[DIM].items()
    expected = {int(k): v.tobytes() for k, v in zip(keys, values)}
    first.update(4, _ids(2, 40))  # after the last checkpoint: lost with the store
    first.close()
    shutil.rmtree(shard_dir(config, 0))
    again = Shard(config)
    keys, values = again.stores[DIM].items()
    assert {int(k): v.tobytes() for k, v in zip(keys, values)} == expected
    assert [(x.life, x.restored_step, x.applied_at_checkpoint) for x in again.losses] == [(life, 3, 3)]
    again.close()
