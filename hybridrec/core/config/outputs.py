"""What a job writes: checkpoints, live model versions, the output directory."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from hybridrec.core.config.section import Section


class CheckpointConfig(Section):
    """Synchronised checkpoints of the whole job (dense model, PS rows, data position)."""

    dir: str | None = None
    """Where synchronised job checkpoints go (`hybridrec run`: <run dir>/checkpoints unless set). None: none at all."""
    interval_steps: Annotated[int, Field(gt=0)] | None = None
    """Checkpoint every this many steps per NN worker (None: no step trigger)."""
    interval_s: Annotated[float, Field(gt=0)] | None = 30.0
    """Checkpoint when this many seconds of training have passed since the last one (None: no time trigger).
    On by default, so that losing every NN worker at once costs about this much training, not the run
    (losing one costs nothing: its peers hand their state to its replacement). The ranks agree on it every
    10 steps with one tiny AllReduce. A checkpoint drains the gradient pushes and has each PS shard stream its
    rows, or those changed since its previous dump (`full_every`), to disk (a full dump: 0.35 s at 1M rows,
    15.6 s at 100M); the interval stretches to 19 times the last
    checkpoint's duration when that is longer, so time checkpoints never take more than 5 % of training."""
    keep: Annotated[int, Field(ge=1)] = 2
    """Newest checkpoints kept (and the older ones their PS deltas build on, see `full_every`)."""
    full_every: Annotated[int, Field(ge=1)] = 8
    """Incremental checkpoints: each PS shard writes the rows changed since its previous dump (a delta) instead
    of every row, and a full dump when its chain (a full dump and the deltas on it) has this many dumps, when
    over half its rows changed, or when it cannot know what changed (its first dump, after a restart or a
    restore). 1: every dump is full. A restore reads the chain's dumps in turn; a chain is deleted once no
    kept checkpoint needs it (docs/architecture.md#checkpoints)."""
    resume: bool = True
    """Start from the newest complete checkpoint in `dir` when there is one (with interval checkpoints on)."""
    job_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    """Names this job in `dir`. PS shards record their lives under it (services/embedding_ps/lives.py): a shard
    that comes back without its store (a lost host, a fresh emptyDir) in a job that has trained it restores its
    part of the newest checkpoint before serving, and the updates lost with it are counted. `hybridrec run`
    draws one per run; a deployment sets one per job. None: no detection (a shard without files starts empty)."""

    @property
    def periodic(self) -> bool:
        """Interval checkpoints (by steps or by time) are on, and so is resuming from them."""
        return bool(self.dir and (self.interval_steps or self.interval_s))
    final: bool = True
    """Write a final checkpoint when training ends (every update applied, before evaluation), whenever `dir`
    is set, with or without an interval: what `hybridrec export` turns into a model bundle."""


class PublishConfig(Section):
    """Live model versions: a training job publishes its model into a directory that inference services follow
    (docs/serving.md#live-versions)."""

    dir: str | None = None
    """Where versions go, one `v00000012/` bundle directory each (None: `hybridrec run` uses <run dir>/versions
    when an interval is set). Every PS shard and NN worker rank 0 must see the same directory."""
    interval_steps: Annotated[int, Field(gt=0)] | None = None
    """Publish every this many training steps of NN worker rank 0 (None: no step trigger)."""
    interval_s: Annotated[float, Field(gt=0)] | None = None
    """Publish when this many seconds have passed since the last publish began (None: no time trigger)."""
    keep: Annotated[int, Field(ge=1)] = 3
    """Newest versions kept besides the newest full snapshot and the deltas after it (with what each needs)."""
    full_every: Annotated[int, Field(ge=1)] = 10
    """Every this many versions is a full snapshot; the others are deltas of the rows changed since the previous
    version. 1: every version is full."""
    at_end: bool = True
    """Publish one last version when training ends: after the final checkpoint when there is one (then every
    rank's updates are applied and the version equals that checkpoint), else after rank 0's pushes are acknowledged."""

    @property
    def enabled(self) -> bool:
        return bool(self.interval_steps or self.interval_s)


class OutputConfig(Section):
    """Where the results go."""

    dir: str = "runs/latest"
    """Where NN worker rank 0 writes summary.json and predictions."""
