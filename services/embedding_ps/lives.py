"""The lives of a PS shard, recorded beside the job's checkpoints: how a shard knows it lost its store.

A shard's life begins when its files are created (its applied-update record
draws a random id, services/embedding_ps/applied.py) and lasts across restarts
of the process: the files survive kill -9. A lost host ends it (a new node, a
fresh emptyDir, a reboot that cleared /dev/shm): the shard starts with no files
at all, which on its own looks exactly like the first start of a job. So each
shard records its lives where the job's checkpoints are, which outlive any PS
host:

```
<checkpoint.dir>/ps-lives/shard-00000.json
    {"job": "<checkpoint.job_id>", "lives": [{"life": 913..., "started_unix": ...,
     "replaced": null | {"life": ..., "applied_at_checkpoint": ..., "restored_step": ...}}]}
```

A shard that starts without files in a job that lists a life for it lost that
life's store: it restores its part of the newest complete checkpoint before it
serves (or, with none yet, starts empty and says so), and records the loss.
What the lost life applied after that checkpoint is gone; `applied_at_checkpoint`
(the updates it had applied when the checkpoint was written, from the shard's
checkpoint manifest) lets the run's summary count exactly those: the embedding
workers' acknowledgements to the lost life minus it (services/nn_worker/results.py).

Every shard writes only its own file, whole (write and rename), so shards never race.
"""
from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel

from hybridrec.core.layouts.checkpoints import PS_LIVES
from hybridrec.core.layouts.files import write_json_atomic


class Loss(BaseModel):
    """A life that lost its store, and what its successor restored."""

    life: int
    applied_at_checkpoint: int
    """Updates the lost life had applied when the restored checkpoint was written (0: the checkpoint is older
    than that life, or there was none)."""
    restored_step: int
    """Step of the restored checkpoint; -1: there was none, the successor started empty (or it copied the
    shard's backup: `from_replica`)."""
    from_replica: bool = False
    """The successor copied the shard from its backup (ps.replicas: 2); `applied_at_checkpoint` is then what
    the backup held of the lost life."""


class Life(BaseModel):
    """One life of the shard in the job: when it began, and the lost life it replaced, if any."""

    life: int
    started_unix: float
    replaced: Loss | None = None
    """The life this one replaced after a lost store (None: the shard's first life in the job)."""


class ShardLives(BaseModel):
    job: str
    lives: list[Life]

    @property
    def losses(self) -> list[Loss]:
        return [life.replaced for life in self.lives if life.replaced is not None]


def path(root: str | Path, shard: int) -> Path:
    return Path(root) / PS_LIVES / f"shard-{shard:05d}.json"


def read(root: str | Path, shard: int, job: str) -> ShardLives | None:
    """The shard's lives in job `job`; None when the job has none recorded (its first start, or another job's
    record: a new job in an old checkpoint directory)."""
    file = path(root, shard)
    if not file.is_file():
        return None
    lives = ShardLives.model_validate_json(file.read_text())
    return lives if lives.job == job else None


def begin(root: str | Path, shard: int, job: str, life: int, known: ShardLives | None,
          replaced: Loss | None = None) -> ShardLives:
    """Record that life `life` of the shard serves job `job` (once per life: a restart of the same life adds
    nothing); returns the record."""
    if known is not None and known.lives and known.lives[-1].life == life:
        return known
    lives = ShardLives(job=job, lives=[*(known.lives if known else []),
                                       Life(life=life, started_unix=time.time(), replaced=replaced)])
    file = path(root, shard)
    file.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(file, lives.model_dump(mode="json"), fsync=True)
    return lives
