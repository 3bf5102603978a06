"""Parquet reader: files in, `Rows` out, one row group at a time. Runs in the data loader process.

Columns are mapped by the config (README "Parquet input"):

* each of `data.labels` is a label column (integer, float or boolean, 0 or 1):
  one task each; a null or other value makes the row bad (`data.bad_lines`:
  skipped and counted, or an error naming the file, row group and row);
* `data.dense_columns` (default I1..I<num_dense>) are float columns, a null
  reads 0.0 (as an empty TSV field);
* each feature reads `column` (default its name): with `kind: scalar` an
  integer or string column (one ID, or none for a null or empty string), with
  `kind: list` a list of integers or strings (null lists and null elements
  add nothing). Strings are hashed exactly as TSV fields, so a Criteo TSV
  converted with `hybridrec data to-parquet` yields the same IDs; integers go
  through splitmix64. A list longer than the feature's `max_len` keeps its
  last (most recent) `max_len` elements and counts in `truncated_rows`.

A missing column, a column of the wrong type, or a list column where a scalar
is configured stops the reader with `ParquetFormatError` naming the file, the
row group and the feature key. Only one row group (of the configured columns)
is in memory at a time; chunks of `chunk_rows` rows span row groups, and each
chunk records the file row after it, so a resumed reader neither re-reads nor
skips a row.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridrec.config import FeatureKind
from hybridrec.criteo_kernels import hash_ints, hash_strings
from hybridrec.ids import GROUP_SHIFT
from hybridrec.jagged import Bag, KeyedBags
from services.dataloader.batching import BadLinePolicy, Position, ReadCounters, Rows
from services.dataloader.splits import WHOLE, Part, Split, whole

if TYPE_CHECKING:
    from hybridrec.config import Config


class ParquetFormatError(ValueError):
    """A Parquet file does not hold what the config maps onto it; the message names file, row group and key."""


@dataclass(frozen=True)
class FeatureColumn:
    """How one configured feature is read."""

    key: str  # the config key, for messages: "features.3 (hist_cats)"
    column: str
    group: int
    kind: FeatureKind
    max_len: int


@dataclass(frozen=True)
class ParquetSpec:
    """Which columns of a file are labels, dense features and ID features (from the config)."""

    labels: tuple[str, ...]
    dense: tuple[str, ...]
    features: tuple[FeatureColumn, ...]

    @classmethod
    def from_config(cls, config: Config) -> "ParquetSpec":
        return cls(tuple(config.data.labels), tuple(config.dense_columns),
                   tuple(FeatureColumn(f"features.{i} ({f.name})", f.source, f.group, f.kind, f.max_len)
                         for i, f in enumerate(config.features)))

    @property
    def columns(self) -> list[str]:
        """Every column read, once each."""
        return list(dict.fromkeys([*self.labels, *self.dense, *(f.column for f in self.features)]))


@dataclass
class ParquetChunk:
    """Up to `chunk_rows` consecutive good rows of one file."""

    rows: Rows
    end_row: int
    """Row of the file (0-based, bad rows included) after the chunk: pass it as `start_row` to resume."""
    num_bad_rows: int
    num_truncated: int

    def __len__(self) -> int:
        return len(self.rows)


def check_columns(path: str, spec: ParquetSpec) -> None:
    """Raise ParquetFormatError naming the first configured column the file lacks (what preflight checks)."""
    names = set(pq.read_schema(path).names)
    for key, column in _keyed_columns(spec):
        if column not in names:
            raise ParquetFormatError(f"{path}: {key}: no column {column!r} (columns: {sorted(names)})")


def _keyed_columns(spec: ParquetSpec) -> list[tuple[str, str]]:
    return ([(f"data.labels ({c})", c) for c in spec.labels] + [(f"data.dense_columns ({c})", c) for c in spec.dense]
            + [(f"{f.key}.column", f.column) for f in spec.features])


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
                 groups: Part = WHOLE) -> Iterator[ParquetChunk]:
    """Chunks of `chunk_rows` good rows from file row `start_row` on (the last may be shorter), of the row
    groups [groups.start, groups.stop) only (a data loader's part of the file: splits.py).

    The file is opened (a missing or unreadable file raised) when called, not on the first `next()`.
    """
    path = os.fspath(path)
    parquet = _open(path)
    check_columns(path, spec)
    return _read(parquet, path, spec, chunk_rows, BadLinePolicy(bad_lines), start_row, groups)


def _read(parquet: pq.ParquetFile, path: str, spec: ParquetSpec, chunk_rows: int, policy: BadLinePolicy,
          start_row: int, groups: Part) -> Iterator[ParquetChunk]:
    pending: list[Rows] = []
    held, bad, truncated = 0, 0, 0
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
        rows, kept, num_bad, num_trunc = _convert(table.slice(skip), spec, (path, group, row0), row0 + skip, policy)
        bad, truncated = bad + num_bad, truncated + num_trunc
        start = 0
        while held + len(rows) - start >= chunk_rows:  # a full chunk: what is held plus this group's next rows
            take = chunk_rows - held
            part = Rows.concat(pending + [rows.slice(start, start + take)])
            end = int(kept[start + take - 1]) + 1
            yield ParquetChunk(part, end, bad, truncated)
            pending, held, bad, truncated, start = [], 0, 0, 0, start + take
        if start < len(rows):
            pending.append(rows.slice(start, len(rows)))
            held += len(rows) - start
        row0 += num
    if held or bad or truncated:
        rows = Rows.concat(pending) if pending else _empty(spec)
        yield ParquetChunk(rows, max(row0, start_row), bad, truncated)


def _empty(spec: ParquetSpec) -> Rows:
    n = len(spec.labels)
    return Rows(np.zeros((0,) if n == 1 else (0, n), np.float32), np.zeros((0, len(spec.dense)), np.float32),
                KeyedBags(np.zeros(0, np.uint64), np.zeros((len(spec.features), 0), np.int64)))


def _convert(table: pa.Table, spec: ParquetSpec, group: tuple[str, int, int], first_row: int,
             policy: BadLinePolicy) -> tuple[Rows, np.ndarray, int, int]:
    """One row group's rows from file row `first_row` on: (Rows of the good rows, their file row numbers, bad
    rows, truncated rows). `group`: (file, row group, its first file row), for messages."""
    path, index, group_row0 = group
    where = f"{path}: row group {index}"
    labels, good = _labels(table, spec.labels, where, first_row, first_row - group_row0, policy)
    kept = np.arange(first_row, first_row + table.num_rows, dtype=np.int64)
    num_bad = int(table.num_rows - good.sum())
    if num_bad:
        table, labels, kept = table.filter(pa.array(good)), labels[good], kept[good]
    dense = np.zeros((table.num_rows, len(spec.dense)), np.float32)
    for j, column in enumerate(spec.dense):
        dense[:, j] = _floats(table.column(column), f"{where}: data.dense_columns ({column})")
    bags = []
    truncated = np.zeros(table.num_rows, bool)  # rows, not features: a row truncated twice counts once
    for feature in spec.features:
        bag, over = _bag(table.column(feature.column), feature, where)
        bags.append(bag)
        truncated |= over
    rows = Rows(labels if labels.shape[1] > 1 else labels[:, 0], dense, KeyedBags.from_bags(bags))
    return rows, kept, num_bad, int(truncated.sum())


def _labels(table: pa.Table, names: Sequence[str], where: str, first_row: int, in_group: int,
            policy: BadLinePolicy) -> tuple[np.ndarray, np.ndarray]:
    """float32 (rows, tasks) labels and the mask of good rows (every label present and 0 or 1)."""
    out = np.zeros((table.num_rows, len(names)), np.float32)
    good = np.ones(table.num_rows, bool)
    for t, name in enumerate(names):
        column = table.column(name)
        kind = column.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise ParquetFormatError(f"{where}: data.labels ({name}): a label column must be integer, float or "
                                     f"boolean, not {kind}")
        values = pc.cast(column, pa.float32()).fill_null(np.nan).to_numpy()
        ok = (values == 0) | (values == 1)
        if policy is BadLinePolicy.ERROR and not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            what = "null" if np.isnan(values[i]) else f"{float(values[i])}, not 0 or 1"
            raise ParquetFormatError(f"{where}, row {in_group + i} (file row {first_row + i}): label column "
                                     f"{name!r} is {what}")
        out[:, t] = np.where(ok, values, 0)
        good &= ok
    return out, good


def _floats(column: pa.ChunkedArray, where: str) -> np.ndarray:
    if not pa.types.is_floating(column.type):
        raise ParquetFormatError(f"{where}: a dense column must be float, not {column.type} (cast it to float32)")
    return pc.cast(column, pa.float32()).fill_null(0.0).to_numpy()


def _bag(column: pa.ChunkedArray, feature: FeatureColumn, where: str) -> tuple[Bag, np.ndarray]:
    """The feature's IDs as a bag per row, and which rows were truncated to max_len."""
    kind = column.type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    key = f"{where}: {feature.key}, column {feature.column!r}"
    if feature.kind == FeatureKind.SCALAR and is_list:
        raise ParquetFormatError(f"{key}: a list column ({kind}) where a scalar is configured; set kind: list")
    if feature.kind == FeatureKind.LIST and not is_list:
        raise ParquetFormatError(f"{key}: kind list needs a list column, not {kind}")
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    group_hi = np.uint64(feature.group << GROUP_SHIFT)
    if not is_list:
        ids, present = _ids(array, group_hi, key)
        return Bag.from_column(ids, present), np.zeros(len(array), bool)
    lengths = pc.list_value_length(array).fill_null(0).to_numpy().astype(np.int64)
    ids, present = _ids(pc.list_flatten(array), group_hi, key)
    return Bag.from_lengths(ids, lengths, present).keep_last(feature.max_len)  # null elements, "" add nothing


def _ids(array: pa.Array, group_hi: np.uint64, key: str) -> tuple[np.ndarray, np.ndarray]:
    """uint64 IDs and presence of an integer or string array (no Python loop over values)."""
    kind = array.type
    present = array.is_valid().to_numpy(zero_copy_only=False).copy()
    out = np.empty(len(array), np.uint64)
    if pa.types.is_integer(kind):
        hash_ints(pc.cast(array.fill_null(0), pa.int64()).to_numpy(), group_hi, out)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        offset_type = np.int64 if pa.types.is_large_string(kind) or pa.types.is_large_binary(kind) else np.int32
        _, offsets_buf, data_buf = array.buffers()[:3]
        offsets = np.frombuffer(offsets_buf, offset_type)[array.offset:array.offset + len(array) + 1]
        data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        hash_strings(data, offsets, group_hi, out, present)
    else:
        raise ParquetFormatError(f"{key}: IDs must be integers or strings, not {kind}")
    return out, present


# ---------------------------------------------------------------- the data loader's two streams


def iter_train_batches(paths: Sequence[str], spec: ParquetSpec, *, epochs: int, batch_size: int,
                       bad_lines: BadLinePolicy | str, counters: ReadCounters,
                       start: Position = Position(), split: Split | None = None) -> Iterator[tuple[Rows, Position]]:
    """Training batches from `start` on (of this loader's `split`: row groups per file), each with the position
    after it (`offset`: the file row; `line`: that row, 1-based): as `batching.iter_train_batches` for TSV."""
    parts = split or whole(len(paths))
    for epoch in range(start.epoch, epochs):
        for index, (path, part) in enumerate(zip(paths, parts)):
            if (epoch, index) < (start.epoch, start.file) or part is None:
                continue
            first = start.offset if (epoch, index) == (start.epoch, start.file) else 0
            for chunk in read_parquet(path, spec, chunk_rows=batch_size, bad_lines=bad_lines, start_row=first,
                                      groups=part):
                _count(counters, chunk)
                if len(chunk):
                    yield chunk.rows, Position(epoch, index, chunk.end_row, chunk.end_row + 1)


def iter_rows(paths: Sequence[str], spec: ParquetSpec, *, chunk_rows: int, bad_lines: BadLinePolicy | str,
              counters: ReadCounters, split: Split | None = None) -> Iterator[Rows]:
    """Chunks of every file in order (of this loader's `split`), the eval stream."""
    for path, part in zip(paths, split or whole(len(paths))):
        if part is None:
            continue
        for chunk in read_parquet(path, spec, chunk_rows=chunk_rows, bad_lines=bad_lines, groups=part):
            _count(counters, chunk)
            if len(chunk):
                yield chunk.rows


def _count(counters: ReadCounters, chunk: ParquetChunk) -> None:
    counters.rows += len(chunk)
    counters.bad_lines += chunk.num_bad_rows
    counters.truncated_rows += chunk.num_truncated
