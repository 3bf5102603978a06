"""Live progress of `hybridrec run`: a rich status line on a terminal, a log line every few seconds otherwise."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from hybridrec import log
from hybridrec.config import Config


def estimate_samples(config: Config) -> int | None:
    """Training samples the job will see: from max_steps, else file sizes / the first file's bytes per row."""
    nn = len(config.cluster.nn_workers)
    if config.training.max_steps:
        return config.training.max_steps * nn * config.training.batch_size
    try:
        with open(config.data.train[0], "rb") as f:
            head = f.read(1 << 20)
        if config.data.train[0].endswith(".gz") or head.count(b"\n") == 0:
            return None
        per_row = len(head) / head.count(b"\n")
        return int(config.training.epochs * sum(Path(p).stat().st_size for p in config.data.train) / per_row)
    except OSError:
        return None


class Progress:
    """Called by the launcher with NN rank 0's status about once a second."""

    def __init__(self, config: Config, *, tty: bool | None = None):
        self.total = estimate_samples(config)
        # NN rank 0 reports its own counters; every rank trains the same number of batches.
        self.ranks = len(config.cluster.nn_workers)
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.every_s = config.training.log_every_s
        self.next_log = 0.0
        self.log = log.get()
        self.live = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self.live = Live("starting services...", console=Console(stderr=True), refresh_per_second=4,
                             transient=True)
            self.live.start()

    def __call__(self, status) -> None:
        fields = self._fields(status)
        if self.live is not None:
            self.live.update(" | ".join(f"{k} {v}" for k, v in fields.items()))
        elif time.monotonic() >= self.next_log:
            self.next_log = time.monotonic() + self.every_s
            self.log.info("progress", **fields)

    def _fields(self, status) -> dict:
        if status is None or status.phase == "starting":
            return {"phase": "starting"}
        samples, rate = status.samples * self.ranks, status.samples_per_sec * self.ranks
        fields = {"phase": status.phase, "step": status.step, "samples": f"{samples:,}",
                  "samples/s": f"{rate:,.0f}", "loss": f"{status.loss:.4f}", "auc": f"{status.train_auc:.4f}"}
        if self.total and rate > 0 and status.phase == "train":
            fields["eta"] = f"{max(0.0, (self.total - samples) / rate):.0f}s"
        return fields

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
