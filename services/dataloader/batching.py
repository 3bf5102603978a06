"""On the data loader: turn file chunks into mini-batches, and deal them evenly to the NN ranks.

Synchronous dense training deadlocks if one rank runs out of batches while
another still waits in an AllReduce, so `deal_evenly` gives every rank the same
number of training batches: the last, incomplete round is split into one
smaller batch per rank (rows are dropped only if fewer remain than ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from services.dataloader.criteo import BadLinePolicy, read_criteo


@dataclass
class Rows:
    """A batch of samples: the ID columns of the configured features and their presence mask."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    present: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> "Rows":
        return Rows(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop], self.present[start:stop])

    @staticmethod
    def concat(parts: Sequence["Rows"]) -> "Rows":
        return Rows(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("labels", "dense", "ids", "present")))


@dataclass
class ReadCounters:
    rows: int = 0
    bad_lines: int = 0
    dropped_rows: int = 0


def iter_rows(paths: Sequence[str], *, columns: np.ndarray, groups: Sequence[int], chunk_rows: int,
              bad_lines: BadLinePolicy | str, counters: ReadCounters) -> Iterator[Rows]:
    """Chunks of every file in order, restricted to the configured feature columns."""
    for path in paths:
        for chunk in read_criteo(path, groups=groups, chunk_rows=chunk_rows, bad_lines=bad_lines):
            counters.bad_lines += chunk.num_bad_lines
            counters.rows += len(chunk)
            if len(chunk):
                yield Rows(chunk.labels, chunk.dense, chunk.ids[:, columns], chunk.present[:, columns])


def iter_batches(chunks: Iterable[Rows], batch_size: int) -> Iterator[Rows]:
    """Fixed-size batches across chunk boundaries; the final batch may be smaller."""
    pending: list[Rows] = []
    held = 0
    for chunk in chunks:
        start = 0
        if held:
            take = min(batch_size - held, len(chunk))
            pending.append(chunk.slice(0, take))
            held += take
            start = take
            if held < batch_size:
                continue
            yield Rows.concat(pending)
            pending, held = [], 0
        while len(chunk) - start >= batch_size:
            yield chunk.slice(start, start + batch_size)
            start += batch_size
        if start < len(chunk):
            pending, held = [chunk.slice(start, len(chunk))], len(chunk) - start
    if held:
        yield Rows.concat(pending)


def deal_evenly(batches: Iterable[Rows], num_ranks: int, counters: ReadCounters) -> Iterator[tuple[int, Rows]]:
    """(rank, batch) pairs, round robin, with the same number of batches for every rank."""
    round_: list[Rows] = []
    for batch in batches:
        round_.append(batch)
        if len(round_) == num_ranks:
            yield from enumerate(round_)
            round_ = []
    if not round_:
        return
    tail = Rows.concat(round_)
    if len(tail) < num_ranks:
        counters.dropped_rows += len(tail)
        return
    bounds = np.linspace(0, len(tail), num_ranks + 1).astype(int)
    for rank in range(num_ranks):
        yield rank, tail.slice(bounds[rank], bounds[rank + 1])
