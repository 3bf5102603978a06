"""On the data loader: turn file chunks into mini-batches, and deal them evenly to the NN ranks.

TSV, Parquet and prepared-data readers all produce `Rows`, whose sparse
features are one `KeyedBags` (a TSV or scalar column is a bag of at most one
ID); from there on a batch takes one path (batching, dealing, `Rows.sparse`,
the frames).

Synchronous dense training deadlocks if one rank runs out of batches while
another still waits in an AllReduce, so `deal_evenly` gives every rank the same
number of training batches: the last, incomplete round is split into one
smaller batch per rank (rows are dropped only if fewer remain than ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

from hybridrec.core.wire.frames import SparseBatch
from hybridrec.core.wire.jagged import KeyedBags
from services.dataloader.splits import Split, whole
from services.dataloader.tsv import BadLinePolicy, CriteoChunk, read_criteo


@dataclass
class Rows:
    """A batch of samples: labels, dense features and the sparse features of the configured features."""

    labels: np.ndarray  # float32 (n,), or (n, tasks) with several label columns
    dense: np.ndarray
    bags: KeyedBags

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> "Rows":
        return Rows(self.labels[start:stop], self.dense[start:stop], self.bags.slice(start, stop))

    @staticmethod
    def concat(parts: Sequence["Rows"]) -> "Rows":
        return Rows(np.concatenate([p.labels for p in parts]), np.concatenate([p.dense for p in parts]),
                    KeyedBags.concat([p.bags for p in parts]))

    @staticmethod
    def from_columns(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray, present: np.ndarray) -> "Rows":
        """Single-valued ID columns (n, F) with a presence mask (TSV: one ID or none per field)."""
        return Rows(labels, dense, KeyedBags.from_columns(ids, present))

    @staticmethod
    def of_chunk(chunk: CriteoChunk, columns: np.ndarray) -> "Rows":
        """A Criteo chunk's rows, restricted to the configured feature columns."""
        return Rows.from_columns(chunk.labels, chunk.dense, chunk.ids[:, columns], chunk.present[:, columns])

    def sparse(self, phase: str) -> SparseBatch:
        """The ID half of the batch, as the embedding worker receives it."""
        return SparseBatch.from_bags(self.bags, phase=phase)


@dataclass(frozen=True, order=True)
class Position:
    """Where the training stream resumes: a checkpoint stores the position after its last batch."""

    epoch: int = 0
    file: int = 0
    offset: int = 0  # byte offset in the file's uncompressed stream (Parquet: the file row)
    line: int = 1  # 1-based line number at that offset (Parquet: that row, 1-based)

    def as_list(self) -> list[int]:
        return [self.epoch, self.file, self.offset, self.line]


@dataclass
class ReadCounters:
    """What a data loader read in one phase: sent to the NN workers with the phase's end, and from rank 0 into
    the summary's `data` (its field names are the summary's keys)."""

    rows: int = 0
    bad_lines: int = 0  # TSV: malformed lines; Parquet: rows with a null or non-0/1 label
    dropped_rows: int = 0
    truncated_rows: int = 0  # Parquet: rows with a list longer than its feature's max_len (most recent kept)
    bad_messages: int = 0  # a stream: messages skipped whole (a format or schema the config cannot read)
    non_finite_rows: int = 0  # rows skipped for a NaN or infinite value (data.non_finite: skip)
    non_finite_by_file: dict[str, int] = field(default_factory=dict)  # those rows per file (a stream: subject)

    def count_nonfinite(self, where: str, rows: int) -> None:
        if rows:
            self.non_finite_rows += rows
            self.non_finite_by_file[where] = self.non_finite_by_file.get(where, 0) + rows


def iter_rows(paths: Sequence[str], *, columns: np.ndarray, groups: Sequence[int], chunk_rows: int,
              bad_lines: BadLinePolicy | str, counters: ReadCounters, split: Split | None = None,
              non_finite: BadLinePolicy | str = BadLinePolicy.ERROR) -> Iterator[Rows]:
    """Chunks of every file in order (of this loader's `split`: splits.py), restricted to the configured
    feature columns."""
    for path, part in zip(paths, split or whole(len(paths))):
        if part is None:
            continue
        chunks = read_criteo(path, groups=groups, chunk_rows=chunk_rows, bad_lines=bad_lines,
                             start_offset=part.start, start_line=None if part.start else 1, end_offset=part.stop,
                             non_finite=non_finite)
        for chunk in chunks:
            _count(counters, chunk)
            if len(chunk):
                yield Rows.of_chunk(chunk, columns)


def _count(counters: ReadCounters, chunk: CriteoChunk) -> None:
    counters.bad_lines += chunk.num_bad_lines
    counters.rows += len(chunk)
    counters.count_nonfinite(chunk.path, chunk.num_nonfinite)


def iter_train_batches(paths: Sequence[str], *, epochs: int, batch_size: int, columns: np.ndarray,
                       groups: Sequence[int], bad_lines: BadLinePolicy | str, counters: ReadCounters,
                       start: Position = Position(), split: Split | None = None,
                       non_finite: BadLinePolicy | str = BadLinePolicy.ERROR) -> Iterator[tuple[Rows, Position]]:
    """Training batches from `start` on (of this loader's `split` of the files: splits.py), each with the
    position right after it.

    One reader chunk is one batch (a file's last batch may be smaller), so every
    batch ends at a byte offset the reader can resume from exactly: a restarted
    job neither re-reads nor skips a sample.
    """
    parts = split or whole(len(paths))
    for epoch in range(start.epoch, epochs):
        for index, (path, part) in enumerate(zip(paths, parts)):
            if (epoch, index) < (start.epoch, start.file) or part is None:
                continue
            resume = (epoch, index) == (start.epoch, start.file) and start.offset >= part.start
            offset = start.offset if resume else part.start
            if part.stop is not None and offset >= part.stop:
                continue
            chunks = read_criteo(path, groups=groups, chunk_rows=batch_size, bad_lines=bad_lines,
                                 start_offset=offset, start_line=start.line if resume else None if offset else 1,
                                 end_offset=part.stop, non_finite=non_finite)
            for chunk in chunks:
                _count(counters, chunk)
                if len(chunk):
                    rows = Rows.of_chunk(chunk, columns)
                    yield rows, Position(epoch, index, chunk.end_offset, chunk.end_line)


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


def deal_evenly(batches: Iterable[tuple[Rows, Position]], num_ranks: int,
                counters: ReadCounters) -> Iterator[tuple[int, Rows, Position]]:
    """(rank, batch, position) round robin, with the same number of batches for every rank."""
    round_: list[tuple[Rows, Position]] = []
    for item in batches:
        round_.append(item)
        if len(round_) == num_ranks:
            for rank, (rows, position) in enumerate(round_):
                yield rank, rows, position
            round_ = []
    if not round_:
        return
    tail = Rows.concat([rows for rows, _ in round_])
    position = round_[-1][1]
    if len(tail) < num_ranks:
        counters.dropped_rows += len(tail)
        return
    bounds = np.linspace(0, len(tail), num_ranks + 1).astype(int)
    for rank in range(num_ranks):
        yield rank, tail.slice(bounds[rank], bounds[rank + 1]), position
