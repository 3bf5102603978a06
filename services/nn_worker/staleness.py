"""On the NN worker: the staleness bound of hybrid training (docs/architecture.md#one-training-batch).

A batch's embedding lookup starts only while at most `staleness` earlier batches have updates the PS has not
acknowledged: the embeddings a step reads are then at most that many updates old. `StalenessGate` holds the
count and the permits (staleness + 1 of them): the prefetcher passes it before each lookup (`enter`), and a
step's push gives its permit back once the PS answered or the update was given up (`acknowledged`). In sync
mode the bound is 0: one batch at a time.
"""
from __future__ import annotations

import asyncio

import numpy as np

from hybridrec.core.runtime.metrics import STALENESS


class StalenessGate:
    """The permits of the staleness bound and the counts behind them; records each lookup's staleness (the
    updates outstanding when it starts) in `hist` (`TrainStats.staleness_hist`, one bucket per value up to the
    bound) and the STALENESS histogram. Single event loop: no lock beyond the semaphore."""

    def __init__(self, bound: int, hist: np.ndarray):
        self.bound, self.hist = bound, hist
        self.permits = asyncio.Semaphore(bound + 1)
        self.issued = 0  # lookups let through
        self.acked = 0  # their updates acknowledged (or given up)

    @property
    def in_flight(self) -> int:
        """Batches looked up whose updates are not yet acknowledged."""
        return self.issued - self.acked

    async def enter(self) -> None:
        """Before a lookup: wait while `bound` + 1 updates are outstanding, then count this one."""
        await self.permits.acquire()
        tau = self.in_flight
        self.hist[min(tau, self.bound)] += 1
        STALENESS.observe(tau)
        self.issued += 1

    def acknowledged(self) -> None:
        """A step's update is settled (applied, or lost and counted): its permit is free again."""
        self.acked += 1
        self.permits.release()
