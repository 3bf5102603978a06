"""On the NN worker: a rank's training counters (`TrainStats`), kept by the trainer and read by the checkpointer,
the hand-over to a replacement, the status and the summary (a module of its own so that none of them imports
the trainer for it)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TrainStats:
    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    last_loss: float = float("nan")
    train_auc: float = float("nan")  # progressive validation: AUC of the window's predictions (progressive.py)
    started: float | None = None
    finished: float | None = None
    wall_offset: float = 0.0  # training time before the checkpoint this run resumed from
    staleness_hist: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    pushes_failed: int = 0
    skipped_batches: int = 0
    skipped_eval_batches: int = 0
    nonfinite_steps: int = 0  # steps whose loss or gradients were NaN or infinite: nothing updated
    exposed_wait_s: float = 0.0  # training: step loop awaiting a batch's embeddings, and (sync) its push + barrier
    compute_s: float = 0.0  # training: forward, backward, AllReduce and optimizer step on the compute thread
    compute_cpu_s: float = 0.0  # the compute thread's CPU time in training steps (pooling, MLP, optimizer)
    restored_samples: int = 0  # the job's samples at the checkpoint this group resumed from (every rank)
    regroups: int = 0  # times this rank's group failed and was re-formed (a peer lost and replaced)
    replayed_dropped: int = 0  # re-sent batches this rank dropped: the group had trained them already
    updates_replayed: int = 0  # of those, updates lost with a predecessor and derived again (`Trainer._settle`)
    ps_acks: Counter = field(default_factory=Counter)
    """(PS shard, its life) -> this rank's updates that life acknowledged: the rank's own record of what a shard
    that loses its store loses (services/embedding_ps/lives.py); logged with train_done."""

    @property
    def wall_s(self) -> float:
        if self.started is None:
            return self.wall_offset
        return self.wall_offset + (self.finished or time.monotonic()) - self.started

    @property
    def trained_here_s(self) -> float:
        """Seconds this process has trained (first step to now or to the end of training), no resumed time."""
        return 0.0 if self.started is None else (self.finished or time.monotonic()) - self.started
