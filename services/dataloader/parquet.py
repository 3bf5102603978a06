"""Parquet reader: files in, `Rows` out, one row group at a time. Runs in the data loader process.

Columns are mapped by the config (README "Parquet input"); the mapping itself, shared with the Arrow record
batches of a stream (stream.py), is columns.py: labels, dense columns, scalar and list features, hashing,
`max_len`, absent values. A missing column, a column of the wrong type, or a list column where a scalar is
configured stops the reader with `ParquetFormatError` (columns.ColumnFormatError) naming the file, the row
group and the feature key. Only one row group (of the configured columns) is in memory at a time; chunks of
`chunk_rows` rows span row groups, and each chunk records the file row after it, so a resumed reader neither
re-reads nor skips a row.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from services.dataloader.batching import BadLinePolicy, Position, ReadCounters, Rows
from services.dataloader.columns import ColumnFormatError, ColumnSpec, FeatureColumn, check_types, convert, empty_rows
from services.dataloader.splits import WHOLE, Part, Split, whole

ParquetFormatError = ColumnFormatError
"""A Parquet file does not hold what the config maps onto it; the message names file, row group and key."""
ParquetSpec = ColumnSpec
"""Which columns of a file are labels, dense features and ID features (from the config)."""
__all__ = ["FeatureColumn", "ParquetFormatError", "ParquetSpec", "check_columns", "iter_rows", "iter_train_batches",
           "read_parquet", "row_groups"]


@dataclass
class ParquetChunk:
    """Up to `chunk_rows` consecutive good rows of one file."""

    rows: Rows
    end_row: int
    """Row of the file (0-based, bad rows included) after the chunk: pass it as `start_row` to resume."""
    num_bad_rows: int
    num_truncated: int
    num_nonfinite: int = 0
    path: str = ""

    def __len__(self) -> int:
        return len(self.rows)


def check_columns(path: str, spec: ParquetSpec) -> None:
    """Raise ParquetFormatError naming the first configured column the file lacks or holds in a type the reader
    refuses, from the file's schema alone (what preflight checks of every file)."""
    check_types(_open(path).schema_arrow, spec, path)


def raw_counts(path: str, spec: ParquetSpec) -> list[str]:
    """The dense columns of `path` read as stored (`data.dense_transform: none`) whose first row group holds
    whole numbers, none negative, up to 10 or more: raw counts (pandas writes a count column with a missing value
    as float64), which train a worse model than their log1p (what `hybridrec check` and `run` point out)."""
    import pyarrow.compute as pc

    parquet = _open(path)
    names = [name for j, name in enumerate(spec.dense) if spec.transform(j) == "none"
             and name in parquet.schema_arrow.names]
    if not names or not parquet.metadata.num_row_groups:
        return []
    table = parquet.read_row_group(0, columns=names)
    out = []
    for name in names:
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            continue
        values = pc.cast(column, pa.float64()).drop_null().to_numpy()
        values = values[np.isfinite(values)]
        if values.size and values.min() >= 0 and values.max() >= 10 and (values == np.trunc(values)).all():
            out.append(name)
    return out


def _open(path: str) -> pq.ParquetFile:
    if not os.path.isfile(path):
        raise FileNotFoundError(2, f"Parquet data file not found: {path}", path)
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ParquetFormatError(f"{path}: not a readable Parquet file ({exc})") from None


def row_groups(path: str | os.PathLike) -> list[int]:
    """The rows of each row group of the file (its footer only): what the data loaders' splits cut."""
    metadata = _open(os.fspath(path)).metadata
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def read_parquet(path: str | os.PathLike, spec: ParquetSpec, *, chunk_rows: int,
                 bad_lines: BadLinePolicy | str = BadLinePolicy.SKIP, start_row: int = 0,
                 groups: Part = WHOLE, non_finite: BadLinePolicy | str = BadLinePolicy.ERROR) -> Iterator[ParquetChunk]:
    """Chunks of `chunk_rows` good rows from file row `start_row` on (the last may be shorter), of the row
    groups [groups.start, groups.stop) only (a data loader's part of the file: splits.py).

    The file is opened (a missing or unreadable file raised) when called, not on the first `next()`.
    """
    path = os.fspath(path)
    parquet = _open(path)
    check_types(parquet.schema_arrow, spec, path)
    return _read(parquet, path, spec, chunk_rows, (BadLinePolicy(bad_lines), BadLinePolicy(non_finite)), start_row,
                 groups)


def _read(parquet: pq.ParquetFile, path: str, spec: ParquetSpec, chunk_rows: int,
          policies: tuple[BadLinePolicy, BadLinePolicy], start_row: int, groups: Part) -> Iterator[ParquetChunk]:
    pending: list[Rows] = []
    held, bad, truncated, nonfinite = 0, 0, 0, 0
    row0 = 0
    count = parquet.metadata.num_row_groups
    stop = count if groups.stop is None else min(groups.stop, count)
    for group in range(stop):
        num = parquet.metadata.row_group(group).num_rows
        if group < groups.start or row0 + num <= start_row:
            row0 += num
            continue
        table = parquet.read_row_group(group, columns=spec.columns)
        skip = max(0, start_row - row0)
        got = convert(table.slice(skip), spec, f"{path}: row group {group}", row0 + skip, skip, *policies)
        rows, kept = got.rows, got.kept
        bad, truncated, nonfinite = bad + got.bad, truncated + got.truncated, nonfinite + got.non_finite
        start = 0
        while held + len(rows) - start >= chunk_rows:  # a full chunk: what is held plus this group's next rows
            take = chunk_rows - held
            part = Rows.concat(pending + [rows.slice(start, start + take)])
            end = int(kept[start + take - 1]) + 1
            yield ParquetChunk(part, end, bad, truncated, nonfinite, path)
            pending, held, bad, truncated, nonfinite, start = [], 0, 0, 0, 0, start + take
        if start < len(rows):
            pending.append(rows.slice(start, len(rows)))
            held += len(rows) - start
        row0 += num
    if held or bad or truncated or nonfinite:
        rows = Rows.concat(pending) if pending else empty_rows(spec)
        yield ParquetChunk(rows, max(row0, start_row), bad, truncated, nonfinite, path)


# ---------------------------------------------------------------- the data loader's two streams


def iter_train_batches(paths: Sequence[str], spec: ParquetSpec, *, epochs: int, batch_size: int,
                       bad_lines: BadLinePolicy | str, counters: ReadCounters,
                       start: Position = Position(), split: Split | None = None,
                       non_finite: BadLinePolicy | str = BadLinePolicy.ERROR) -> Iterator[tuple[Rows, Position]]:
    """Training batches from `start` on (of this loader's `split`: row groups per file), each with the position
    after it (`offset`: the file row; `line`: that row, 1-based): as `batching.iter_train_batches` for TSV."""
    parts = split or whole(len(paths))
    for epoch in range(start.epoch, epochs):
        for index, (path, part) in enumerate(zip(paths, parts)):
            if (epoch, index) < (start.epoch, start.file) or part is None:
                continue
            first = start.offset if (epoch, index) == (start.epoch, start.file) else 0
            for chunk in read_parquet(path, spec, chunk_rows=batch_size, bad_lines=bad_lines, start_row=first,
                                      groups=part, non_finite=non_finite):
                _count(counters, chunk)
                if len(chunk):
                    yield chunk.rows, Position(epoch, index, chunk.end_row, chunk.end_row + 1)


def iter_rows(paths: Sequence[str], spec: ParquetSpec, *, chunk_rows: int, bad_lines: BadLinePolicy | str,
              counters: ReadCounters, split: Split | None = None,
              non_finite: BadLinePolicy | str = BadLinePolicy.ERROR) -> Iterator[Rows]:
    """Chunks of every file in order (of this loader's `split`), the eval stream."""
    for path, part in zip(paths, split or whole(len(paths))):
        if part is None:
            continue
        for chunk in read_parquet(path, spec, chunk_rows=chunk_rows, bad_lines=bad_lines, groups=part,
                                  non_finite=non_finite):
            _count(counters, chunk)
            if len(chunk):
                yield chunk.rows


def _count(counters: ReadCounters, chunk: ParquetChunk) -> None:
    counters.rows += len(chunk)
    counters.bad_lines += chunk.num_bad_rows
    counters.truncated_rows += chunk.num_truncated
    counters.count_nonfinite(chunk.path, chunk.num_nonfinite)
