"""On the data loaders (and the CLI's preflight): which part of the data each of L data loaders reads.

With `cluster.dataloader` listing L addresses, loader l (replica l) reads split l of `data.train`, and of
`data.eval` the same way. The splits are contiguous ranges of the list's data taken as one sequence, cut
into L nearly equal pieces, so each loader reads few files and few files are cut (a cut file's last batch
is smaller):

* plain TSV files: byte ranges of the files' bytes taken end to end, each cut moved to the next line start
  in its file (a line belongs to the range that holds its first byte: the classic input-split rule), so the
  ranges hold every line exactly once;
* gzip TSV files: whole files (a gzip stream cannot be entered in the middle), the i-th gzip file of the list
  to loader i mod L;
* Parquet files: the files' row groups taken end to end, cut into L contiguous ranges of nearly equal rows,
  at least one row group each;
* prepared directories (`hybridrec data prepare`): their shards' rows taken end to end, cut into L
  contiguous row ranges.

A loader's split is one `Part` (or None: none of it) per file of the list, so the reader's `Position`
(epoch, file, offset, line) keeps its meaning inside a split: the file's index in the list and an offset in
that file. Training data a loader would get nothing of is refused at start naming `cluster.dataloader` (more
loaders than gzip files, Parquet row groups or prepared rows); evaluation data is split the same way, and a
loader with none of it just ends the phase.
"""
from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import Sequence

from hybridrec.core.config import ConfigError

_SEEK_BYTES = 1 << 16


@dataclass(frozen=True)
class Part:
    """The part of one file a loader reads: [start, stop). TSV: byte offsets, both line starts; Parquet: row
    groups; prepared data: rows. `stop` None: to the end."""

    start: int = 0
    stop: int | None = None


WHOLE = Part()
Split = tuple["Part | None", ...]
"""A loader's split: per file (or shard) of the list, the part it reads, or None."""


def whole(files: int) -> Split:
    """Everything: the split of the only loader."""
    return (WHOLE,) * files


def next_line_start(path: str | os.PathLike, offset: int) -> int:
    """The first line start at or after byte `offset` of a plain file (a line starts at 0 and after each
    newline); the file's size when no line starts there."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        at = offset - 1
        while chunk := f.read(_SEEK_BYTES):
            found = chunk.find(b"\n")
            if found >= 0:
                return at + found + 1
            at += len(chunk)
        return at


def cut(total: int, loaders: int, loader: int) -> tuple[int, int]:
    """Loader `loader`'s range [a, b) of `total` units cut into `loaders` nearly equal contiguous ranges."""
    return total * loader // loaders, total * (loader + 1) // loaders


def tsv_split(paths: Sequence[str], gzipped: Sequence[bool], sizes: Sequence[int], loader: int,
              loaders: int) -> Split:
    """Loader `loader`'s part of each TSV file: of the plain files' bytes end to end, its byte range with each
    cut moved to its file's next line start; of the gzip files, every `loaders`-th, whole."""
    total = sum(size for size, gz in zip(sizes, gzipped) if not gz)
    a, b = cut(total, loaders, loader)
    out: list[Part | None] = []
    origin = gz_index = 0
    for path, gz, size in zip(paths, gzipped, sizes):
        if gz:
            out.append(WHOLE if gz_index % loaders == loader else None)
            gz_index += 1
            continue
        lo, hi = max(a, origin), min(b, origin + size)
        part = None
        if lo < hi:
            start = next_line_start(path, lo - origin) if lo > origin else 0
            stop = next_line_start(path, hi - origin) if hi < origin + size else size
            part = Part(start, None if stop == size else stop) if start < stop else None
        out.append(part)
        origin += size
    return tuple(out)


def row_split(rows: Sequence[int], loader: int, loaders: int) -> Split:
    """Loader `loader`'s rows of each shard: of every shard's rows end to end, its contiguous range. A shard
    without rows goes, as an empty part, to the loader whose range starts at or holds its place (the last
    loader at the very end), which reads it to its end and so counts the source's bad lines once."""
    total = sum(rows)
    a, b = cut(total, loaders, loader)
    last = loader == loaders - 1
    out: list[Part | None] = []
    origin = 0
    for n in rows:
        lo, hi = max(a, origin), min(b, origin + n)
        if lo < hi:
            out.append(Part(lo - origin, hi - origin))
        elif n == 0 and (a <= origin < b or (last and origin == total)):
            out.append(Part(0, 0))
        else:
            out.append(None)
        origin += n
    return tuple(out)


def group_split(groups: Sequence[Sequence[int]], loader: int, loaders: int) -> Split:
    """Loader `loader`'s row groups of each Parquet file (`groups`: each file's rows per row group): of every
    file's groups end to end, a contiguous range of nearly `1 / loaders` of the rows, at least one group
    (when there are at least `loaders` groups; otherwise the last loaders get none)."""
    sizes = [n for file in groups for n in file]
    bounds = _group_bounds(sizes, loaders)
    a, b = bounds[loader], bounds[loader + 1]
    out: list[Part | None] = []
    origin = 0
    for file in groups:
        lo, hi = max(a, origin), min(b, origin + len(file))
        out.append(Part(lo - origin, hi - origin) if lo < hi else None)
        origin += len(file)
    return tuple(out)


def _group_bounds(sizes: Sequence[int], loaders: int) -> list[int]:
    """Indices 0 = g_0 <= ... <= g_L = len(sizes): each range as near 1/L of the rows as whole groups allow,
    non-empty while groups last."""
    cumulative = [0]
    for n in sizes:
        cumulative.append(cumulative[-1] + n)
    total, count = cumulative[-1], len(sizes)
    if count < loaders:  # one group each, while they last
        return [min(l, count) for l in range(loaders + 1)]
    bounds = [0]
    for l in range(1, loaders):
        target = bisect.bisect_left(cumulative, total * l / loaders)
        bounds.append(min(max(target, bounds[-1] + 1), count - (loaders - l)))
    bounds.append(count)
    return bounds


def refuse_empty(splits: Sequence[Split], key: str, what: str, advice: str) -> None:
    """ConfigError naming `cluster.dataloader` when a loader's split of the training data is empty."""
    empty = [l for l, split in enumerate(splits)
             if all(part is None or (part.stop is not None and part.stop <= part.start) for part in split)]
    if empty:
        loaders = len(splits)
        raise ConfigError(f"cluster.dataloader: {loaders} data loaders, but {key} holds {what}, so loader"
                          f"{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} would read nothing; "
                          f"{advice}")
