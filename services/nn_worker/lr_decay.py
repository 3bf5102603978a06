"""The dense learning rate's linear fall over a run's last steps (`optimizer.dense.decay`).

Why: a model's calibration is a property of one snapshot, and at a constant learning rate the snapshot a run
ends on is a draw from a wandering state. Trained at the example's Adam rate (0.002), the click model's mean
prediction on a fixed file moves by up to 20 % within a few steps (1M synthetic rows, stopped at steps
470, 474, 478 and 482: 0.93, 1.11, 1.03 and 0.90 times the click rate) while its progressive calibration,
averaged over the last window, stays within 1 %. Letting the rate fall over the last quarter of the run ends it
on a settled model (the same stops: 1.006 to 1.015) at the same AUC. docs/benchmarks.md has the runs.

The fall needs the run's length on each rank: `training.max_steps`, or the Parquet training files' row count
(their footers) times the epochs over the batch of every NN worker. The config refuses the key where neither
is known ahead (a stream, TSV files).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from hybridrec.core.config import Config, ConfigError


@dataclass(frozen=True)
class LrDecay:
    """The learning rate of each step: `base` until `start`, then falling linearly to `base * floor` at
    `total` (and held there, should the run go on: its length is counted ahead from the files' rows)."""

    base: float
    start: int
    total: int
    floor: float

    def lr(self, step: int) -> float:
        """The rate of (1-based) `step`."""
        if step <= self.start:
            return self.base
        left = max(0.0, (self.total - step) / (self.total - self.start))
        return self.base * (self.floor + (1.0 - self.floor) * left)

    @property
    def falls(self) -> bool:
        """Whether the rate changes at all in the run (a captured step of an optimizer that holds its rate as a
        number could not follow it)."""
        return self.start < self.total and self.floor != 1.0

    @classmethod
    def from_config(cls, config: Config) -> "LrDecay":
        """The configured fall; without `optimizer.dense.decay`, `lr` throughout. Either way every step sets
        its rate, so a run resumed from a checkpoint trains at the config's rate, not at the one the
        checkpoint's optimizer state ended on (0, after a fall)."""
        decay = config.optimizer.dense.decay
        if decay is None:
            return cls(base=config.optimizer.dense.lr, start=sys.maxsize, total=sys.maxsize, floor=1.0)
        total = run_steps(config)
        return cls(base=config.optimizer.dense.lr, start=total - max(1, round(decay.last * total)), total=total,
                   floor=decay.to)


def run_steps(config: Config) -> int:
    """Each rank's steps in the run: `training.max_steps`, else the training files' rows (Parquet footers) times
    the epochs over the rows of one step of every NN worker. A file not readable here is a ConfigError naming the
    key and the file (an NN worker deployed without the data: set training.max_steps)."""
    training = config.training
    if training.max_steps:
        return training.max_steps
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 0
    for path in config.data.train:
        try:
            rows += pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"optimizer.dense.decay: the run's length is counted from data.train's rows, and "
                             f"{path} cannot be read here ({exc}); set training.max_steps") from exc
    per_step = training.batch_size * len(config.cluster.nn_workers)
    return max(1, math.ceil(rows * training.epochs / per_step))
