"""The training data's columns as `Rows`: one converter for a Parquet row group (parquet.py) and an Arrow
record batch from a stream message (stream.py), so both read the same columns with the same semantics.

Columns are mapped by the config (README "Parquet input"):

* each of `data.labels` is a label column (integer, float or boolean, 0 or 1):
  one task each; a null or other value makes the row bad (`data.bad_lines`:
  skipped and counted, or an error naming where and the row);
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
is configured raises `ColumnFormatError` naming where (a file and row group, or
a stream's subject and message) and the config key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hybridrec.config import FeatureKind
from hybridrec.criteo_kernels import hash_ints, hash_strings
from hybridrec.ids import GROUP_SHIFT
from hybridrec.jagged import Bag, KeyedBags
from services.dataloader.batching import BadLinePolicy, Rows

if TYPE_CHECKING:
    from hybridrec.config import Config


class ColumnFormatError(ValueError):
    """A table does not hold what the config maps onto it; the message names where (file and row group, or
    subject and message), the config key and the column."""


@dataclass(frozen=True)
class FeatureColumn:
    """How one configured feature is read."""

    key: str  # the config key, for messages: "features.3 (hist_cats)"
    column: str
    group: int
    kind: FeatureKind
    max_len: int


@dataclass(frozen=True)
class ColumnSpec:
    """Which columns are labels, dense features and ID features (from the config)."""

    labels: tuple[str, ...]
    dense: tuple[str, ...]
    features: tuple[FeatureColumn, ...]

    @classmethod
    def from_config(cls, config: Config) -> "ColumnSpec":
        return cls(tuple(config.data.labels), tuple(config.dense_columns),
                   tuple(FeatureColumn(f"features.{i} ({f.name})", f.source, f.group, f.kind, f.max_len)
                         for i, f in enumerate(config.features)))

    @property
    def columns(self) -> list[str]:
        """Every column read, once each."""
        return list(dict.fromkeys([*self.labels, *self.dense, *(f.column for f in self.features)]))

    def keyed_columns(self) -> list[tuple[str, str]]:
        """(config key, column) of every column read, labels first: what messages name."""
        return ([(f"data.labels ({c})", c) for c in self.labels] + [(f"data.dense_columns ({c})", c)
                                                                  for c in self.dense]
                + [(f"{f.key}.column", f.column) for f in self.features])

    def missing(self, names: Iterable[str]) -> tuple[str, str] | None:
        """(config key, column) of the first configured column not among `names`, or None."""
        present = set(names)
        return next(((key, column) for key, column in self.keyed_columns() if column not in present), None)


def check_names(names: Sequence[str], spec: ColumnSpec, where: str) -> None:
    """ColumnFormatError naming `where`, the key and the column when a configured column is not in `names`."""
    if (missing := spec.missing(names)) is not None:
        key, column = missing
        raise ColumnFormatError(f"{where}: {key}: no column {column!r} (columns: {sorted(names)})")


def empty_rows(spec: ColumnSpec) -> Rows:
    n = len(spec.labels)
    return Rows(np.zeros((0,) if n == 1 else (0, n), np.float32), np.zeros((0, len(spec.dense)), np.float32),
                KeyedBags(np.zeros(0, np.uint64), np.zeros((len(spec.features), 0), np.int64)))


def convert(table: pa.Table, spec: ColumnSpec, where: str, first_row: int, in_part: int,
            policy: BadLinePolicy) -> tuple[Rows, np.ndarray, int, int]:
    """`table`'s rows (row `first_row` of its source onwards; row `in_part` of the part `where` names, a Parquet
    row group or a stream message): (Rows of the good rows, their source row numbers, bad rows, truncated
    rows). Raises ColumnFormatError naming `where` and the key for a column of the wrong type."""
    labels, good = _labels(table, spec.labels, where, first_row, in_part, policy)
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


def _labels(table: pa.Table, names: Sequence[str], where: str, first_row: int, in_part: int,
            policy: BadLinePolicy) -> tuple[np.ndarray, np.ndarray]:
    """float32 (rows, tasks) labels and the mask of good rows (every label present and 0 or 1)."""
    out = np.zeros((table.num_rows, len(names)), np.float32)
    good = np.ones(table.num_rows, bool)
    for t, name in enumerate(names):
        column = table.column(name)
        kind = column.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise ColumnFormatError(f"{where}: data.labels ({name}): a label column must be integer, float or "
                                    f"boolean, not {kind}")
        values = pc.cast(column, pa.float32()).fill_null(np.nan).to_numpy()
        ok = (values == 0) | (values == 1)
        if policy is BadLinePolicy.ERROR and not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            what = "null" if np.isnan(values[i]) else f"{float(values[i])}, not 0 or 1"
            raise ColumnFormatError(f"{where}, row {in_part + i} (file row {first_row + i}): label column "
                                    f"{name!r} is {what}")
        out[:, t] = np.where(ok, values, 0)
        good &= ok
    return out, good


def _floats(column: pa.ChunkedArray, where: str) -> np.ndarray:
    if not pa.types.is_floating(column.type):
        raise ColumnFormatError(f"{where}: a dense column must be float, not {column.type} (cast it to float32)")
    return pc.cast(column, pa.float32()).fill_null(0.0).to_numpy()


def _bag(column: pa.ChunkedArray, feature: FeatureColumn, where: str) -> tuple[Bag, np.ndarray]:
    """The feature's IDs as a bag per row, and which rows were truncated to max_len."""
    kind = column.type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    key = f"{where}: {feature.key}, column {feature.column!r}"
    if feature.kind == FeatureKind.SCALAR and is_list:
        raise ColumnFormatError(f"{key}: a list column ({kind}) where a scalar is configured; set kind: list")
    if feature.kind == FeatureKind.LIST and not is_list:
        raise ColumnFormatError(f"{key}: kind list needs a list column, not {kind}")
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
        raise ColumnFormatError(f"{key}: IDs must be integers or strings, not {kind}")
    return out, present
