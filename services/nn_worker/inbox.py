"""On the NN worker: what the data loaders sent this rank, and the one order in which every rank takes it.

Each data loader (`cluster.dataloader`) has a bounded queue of its own here
(`training.prefetch + 2` frames: a full one pushes back on that loader only),
filled by `PutBatch` and drained by the trainer's prefetcher.

Training batches are taken in an order that depends on nothing but the
streams, so that every rank takes the same loader's batch at the same step
(the step's AllReduce meets batches of one round) and every rank takes the same
number of steps: the next batch comes from the loader, among those whose end of
training has not been taken, of which this rank has taken the fewest batches
(the lowest index on a tie): loaders 0, 1, ..., L-1, 0, 1, ... while all have
data. Each loader deals its batches evenly to the ranks (its k-th batch to rank
k mod N), so every rank meets each loader's end at the same step, and a loader
whose end has been taken leaves the turn on every rank alike. The order's state
is the count of batches taken per loader, which a checkpoint (each loader's
`seq`) and a hand-over to a replacement (`Ledger.loader_steps`) carry.

Evaluation batches are not dealt evenly and no collective meets them, so they
are taken in whatever order they arrive: waiting on one loader while another
loader's batches wait behind a full queue could deadlock two ranks.
"""
from __future__ import annotations

import asyncio
from typing import Any

from hybridrec.core.wire.frames import DenseBatch, EndOfPhase


class Inbox:
    """One bounded queue per data loader, and an event set whenever a frame arrives."""

    def __init__(self, loaders: int, maxsize: int):
        self.queues: list[asyncio.Queue] = [asyncio.Queue(maxsize=maxsize) for _ in range(loaders)]
        self._waiting = [0] * loaders  # puts waiting for room, per loader
        self._arrived = asyncio.Event()

    @property
    def loaders(self) -> int:
        return len(self.queues)

    def qsize(self) -> int:
        return sum(q.qsize() for q in self.queues)

    async def put(self, item: DenseBatch | EndOfPhase) -> None:
        """Queue `item` behind its loader's earlier frames; waits while that loader's queue is full."""
        loader = item.loader
        self._waiting[loader] += 1
        try:
            await self.queues[loader].put(item)
        finally:
            self._waiting[loader] -= 1
        self._arrived.set()

    def put_nowait(self, item: DenseBatch | EndOfPhase) -> bool:
        """Queue `item` if its loader's queue has room and no earlier put waits for it (which would then come
        after it); False, and nothing queued, otherwise (`put` waits)."""
        queue = self.queues[item.loader]
        if self._waiting[item.loader] or queue.full():
            return False
        queue.put_nowait(item)
        self._arrived.set()
        return True

    async def get(self, loader: int) -> DenseBatch | EndOfPhase:
        """The next frame of `loader`, waiting for it."""
        return await self.queues[loader].get()

    async def get_any(self, loaders: list[int]) -> DenseBatch | EndOfPhase:
        """The next frame of any of `loaders`, whichever has one first (the lowest index of those waiting)."""
        while True:
            for loader in loaders:
                if not self.queues[loader].empty():
                    return self.queues[loader].get_nowait()
            self._arrived.clear()  # no await since the look above: nothing can have arrived in between
            await self._arrived.wait()


def next_loader(taken: list[int], ended: set[int]) -> int | None:
    """The loader whose training batch comes next: of those not `ended`, the one this rank has `taken` the
    fewest batches of, the lowest index on a tie; None when every loader has ended."""
    live = [loader for loader in range(len(taken)) if loader not in ended]
    return min(live, key=lambda loader: (taken[loader], loader)) if live else None


def merge_ends(ends: dict[int, EndOfPhase]) -> dict[str, Any]:
    """The run's account of a phase from every loader's end (their read counters): with one loader its own;
    with several, the counters summed and each loader's own under `loaders`."""
    metas = [ends[loader].meta for loader in sorted(ends)]
    if len(metas) == 1:
        return dict(metas[0])
    summed: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key != "first_seq" and isinstance(value, (int, float)) and not isinstance(value, bool):
                summed[key] = summed.get(key, 0) + value
            elif isinstance(value, dict):  # counts per file (each loader reads its own part of a file)
                into = summed.setdefault(key, {})
                for name, count in value.items():
                    into[name] = into.get(name, 0) + count
    return {**summed, "loaders": [dict(meta) for meta in metas]}
