"""Live progress of `hybridrec run`: a rich status line on a terminal, a log line every few seconds otherwise."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from hybridrec.core.runtime import log
from hybridrec.core.config import Config


def estimate_samples(config: Config) -> int | None:
    """Training samples the job will see: from max_steps, else file sizes / the first file's bytes per row."""
    nn = len(config.cluster.nn_workers)
    if config.training.max_steps:
        return config.training.max_steps * nn * config.training.batch_size
    if config.data.stream is not None:  # how far a stream goes is not known ahead
        return None
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
    """Called by the launcher about once a second with every NN worker's status (None: did not answer)."""

    def __init__(self, config: Config, *, tty: bool | None = None):
        self.total = estimate_samples(config)
        self.ranks = len(config.cluster.nn_workers)
        self.last: dict[int, object] = {}  # each rank's last answer: one missed poll does not dent the totals
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

    def __call__(self, statuses) -> None:
        if not isinstance(statuses, (list, tuple)):
            statuses = [statuses]
        for rank, status in enumerate(statuses):
            if status is not None and status.phase != "starting":
                self.last[rank] = status
        fields = self._fields()
        if self.live is not None:
            self.live.update(" | ".join(f"{k} {v}" for k, v in fields.items()))
        elif time.monotonic() >= self.next_log:
            self.next_log = time.monotonic() + self.every_s
            self.log.info("progress", **fields)

    def _fields(self) -> dict:
        """The whole run's numbers: samples and samples/s summed over the NN workers, loss and AUC averaged."""
        if not self.last:
            return {"phase": "starting"}
        ranks = list(self.last.values())
        phases = {s.phase for s in ranks}
        phase = "train" if "train" in phases else ("eval" if "eval" in phases else "done")
        samples = sum(s.samples for s in ranks)
        rate = sum(s.samples_per_sec for s in ranks)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        fields = {"phase": phase, "step": max(s.step for s in ranks), "samples": f"{samples:,}",
                  "samples/s": f"{rate:,.0f}", "loss": f"{mean([s.loss for s in ranks]):.4f}",
                  "auc": f"{mean([s.train_auc for s in ranks]):.4f}"}
        if len(ranks) < self.ranks:
            fields["ranks"] = f"{len(ranks)}/{self.ranks}"
        if self.total and rate > 0 and phase == "train":
            fields["eta"] = f"{max(0.0, (self.total - samples) / rate):.0f}s"
        return fields

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
