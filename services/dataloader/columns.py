"""The training data's columns as `Rows`: one converter for a Parquet row group (parquet.py) and an Arrow
record batch from a stream message (stream.py), so both read the same columns with the same semantics.

Columns are mapped by the config (README "Parquet input"):

* each of `data.labels` is a label column (boolean, integer, float or decimal): one task each, holding 0 or 1
  for a binary task, any finite number for a regression one; `data.weight_column`, when set, holds each row's
  sample weight (finite, >= 0) and is read as one more label column, after the tasks'. A null or another
  value makes the row bad (`data.bad_lines`: skipped and counted, or an error naming where, the row and the
  column);
* `data.dense_columns` (default I1..I<num_dense>) are float, integer, decimal or boolean columns, each
  transformed as `data.dense_transform` says (`none`, or `log1p`: log1p(max(x, 0)), what the TSV reader
  computes from its integer columns); a null reads 0.0 (as an empty TSV field). A NaN or infinite value, or
  one past float32's range, follows `data.non_finite` (the row skipped and counted, or an error naming where,
  the row and the column);
* each feature reads `column` (default its name): with `kind: scalar` an integer, string or binary column
  (one ID, or none for a null or empty string), with `kind: list` a list of them (null lists and null
  elements add nothing). Strings are hashed exactly as TSV fields, so a Criteo TSV converted with `hybridrec
  data to-parquet` yields the same IDs; an integer's 64 bits go through splitmix64, whatever its width and
  sign (uint64 over all 2**64 values: a value below 2**63 gets the ID it has as int64). A float column of
  whole numbers (pandas writes an integer column with missing values as float64) is read as those integers,
  NaN as absent. Dictionary-encoded columns are read as their values. A list longer than the feature's
  `max_len` keeps its last (most recent) `max_len` elements and counts in `truncated_rows`.

A missing column, a column of the wrong type, or a list column where a scalar is configured raises
`ColumnFormatError` naming where (a file and row group, or a stream's subject and message) and the config key.
`check_types` makes the same type checks from a schema alone (what `hybridrec check` reads of every file).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hybridrec.core.config import FeatureKind
from hybridrec.core.layouts.criteo_kernels import hash_ints, hash_strings
from hybridrec.core.wire.ids import GROUP_SHIFT
from hybridrec.core.wire.jagged import Bag, KeyedBags
from services.dataloader.batching import BadLinePolicy, Rows

if TYPE_CHECKING:
    from hybridrec.core.config import Config


class ColumnFormatError(ValueError):
    """A table does not hold what the config maps onto it; the message names where (file and row group, or
    subject and message), the config key and the column."""


class RowError(ColumnFormatError):
    """A row refused under a policy set to `error` (`data.bad_lines`: a bad label or weight;
    `data.non_finite`: a NaN or infinite dense value), naming where, the row and the column."""


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
    """Which columns are labels, dense features and ID features (from the config), and how each dense column
    is transformed."""

    labels: tuple[str, ...]
    dense: tuple[str, ...]
    features: tuple[FeatureColumn, ...]
    transforms: tuple[str, ...] = ()
    """Each dense column's `data.dense_transform` (none or log1p); empty: none for all."""
    regression: tuple[bool, ...] = ()
    """Which labels are a regression task's (any finite number), not a binary one's (0 or 1); empty: none."""
    weight: str | None = None
    """`data.weight_column`: read after the labels, as one more label column (finite, >= 0)."""

    @classmethod
    def from_config(cls, config: Config) -> "ColumnSpec":
        return cls(tuple(config.data.label_names), tuple(config.dense_columns),
                   tuple(FeatureColumn(f"features.{i} ({f.name})", f.source, f.group, f.kind, f.max_len)
                         for i, f in enumerate(config.features)), tuple(config.dense_transforms),
                   tuple(not t.binary for t in config.data.tasks), config.data.weight_column)

    @property
    def label_columns(self) -> list[tuple[str, str, str]]:
        """(config key, column, kind: binary, regression or weight) of every column read into the labels."""
        kinds = self.regression or (False,) * len(self.labels)
        out = [(f"data.labels ({c})", c, "regression" if r else "binary") for c, r in zip(self.labels, kinds)]
        return out + ([("data.weight_column", self.weight, "weight")] if self.weight else [])

    def transform(self, j: int) -> str:
        return self.transforms[j] if self.transforms else "none"

    @property
    def columns(self) -> list[str]:
        """Every column read, once each."""
        return list(dict.fromkeys([*(c for _, c, _ in self.label_columns), *self.dense,
                                   *(f.column for f in self.features)]))

    def keyed_columns(self) -> list[tuple[str, str]]:
        """(config key, column) of every column read, labels first: what messages name."""
        return ([(key, c) for key, c, _ in self.label_columns] + [(f"data.dense_columns ({c})", c)
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


def check_types(schema: pa.Schema, spec: ColumnSpec, where: str) -> None:
    """ColumnFormatError naming `where`, the key and the column for a configured column whose type the
    converter would refuse (labels, dense columns, features): what `hybridrec check` reads of every file before
    anything starts, from its schema alone."""
    check_names(schema.names, spec, where)
    for key, name, _ in spec.label_columns:
        _check_label_type(schema.field(name).type, f"{where}: {key}")
    for name in spec.dense:
        _check_dense_type(schema.field(name).type, f"{where}: data.dense_columns ({name})")
    for feature in spec.features:
        kind = _value_type(schema.field(feature.column).type)
        key = f"{where}: {feature.key}, column {feature.column!r}"
        is_list = _is_list(kind)
        _check_list_kind(feature, kind, is_list, key)
        _check_id_type(_value_type(kind.value_type) if is_list else kind, key)


def empty_rows(spec: ColumnSpec) -> Rows:
    n = len(spec.label_columns)
    return Rows(np.zeros((0,) if n == 1 else (0, n), np.float32), np.zeros((0, len(spec.dense)), np.float32),
                KeyedBags(np.zeros(0, np.uint64), np.zeros((len(spec.features), 0), np.int64)))


@dataclass
class Converted:
    """A table's good rows and what was left out of it."""

    rows: Rows
    kept: np.ndarray
    """The source row number of each good row."""
    bad: int
    """Rows with a bad label or weight (`data.bad_lines: skip`): null, a binary label not 0 or 1, a regression
    label not finite, a weight not finite or negative."""
    non_finite: int
    """Rows with a NaN or infinite dense value (`data.non_finite: skip`)."""
    truncated: int
    """Good rows with a list longer than its feature's max_len."""


def convert(table: pa.Table, spec: ColumnSpec, where: str, first_row: int, in_part: int,
            policy: BadLinePolicy, non_finite: BadLinePolicy = BadLinePolicy.ERROR) -> Converted:
    """`table`'s rows (row `first_row` of its source onwards; row `in_part` of the part `where` names, a Parquet
    row group or a stream message). Raises ColumnFormatError naming `where` and the key for a column of the
    wrong type, and, under the ERROR policies, for a bad label or a value that is not finite."""
    labels, good = _labels(table, spec.label_columns, where, first_row, in_part, policy)
    dense, finite_values = _dense(table, spec, where)
    finite = finite_values.all(axis=1)
    not_finite = good & ~finite  # a row with a bad label is counted as that
    if not_finite.any() and non_finite is BadLinePolicy.ERROR:
        i = int(np.flatnonzero(not_finite)[0])
        column = spec.dense[int(np.flatnonzero(~finite_values[i])[0])]
        raise RowError(f"{where}, row {in_part + i} (file row {first_row + i}): data.dense_columns ({column}) is "
                       f"{_value_text(table.column(column), i)}, not a finite number (data.non_finite: skip to "
                       f"skip such rows)")
    keep = good & finite
    kept = np.arange(first_row, first_row + table.num_rows, dtype=np.int64)
    if not keep.all():
        table, labels, dense, kept = table.filter(pa.array(keep)), labels[keep], dense[keep], kept[keep]
    bags = []
    truncated = np.zeros(table.num_rows, bool)  # rows, not features: a row truncated twice counts once
    for feature in spec.features:
        bag, over = _bag(table.column(feature.column), feature, where)
        bags.append(bag)
        truncated |= over
    rows = Rows(labels if labels.shape[1] > 1 else labels[:, 0], dense, KeyedBags.from_bags(bags))
    return Converted(rows, kept, int((~good).sum()), int(not_finite.sum()), int(truncated.sum()))


def _value_text(column: pa.ChunkedArray, i: int) -> str:
    value = column[i].as_py()
    return repr(value) if not isinstance(value, float) else str(value)


def _value_type(kind: pa.DataType) -> pa.DataType:
    """The type a column's values have: a dictionary's value type, or the type itself."""
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def _decoded(column: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """A dictionary-encoded column as its values (pandas categoricals, Spark's dictionary pages)."""
    if pa.types.is_dictionary(column.type):
        return pc.cast(column, column.type.value_type)
    return column


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)


def _check_label_type(kind: pa.DataType, key: str) -> None:
    kind = _value_type(kind)
    if not (_is_number(kind) or pa.types.is_boolean(kind)):
        raise ColumnFormatError(f"{key}: a label column must be boolean, integer or float, not {kind}")


def _check_dense_type(kind: pa.DataType, key: str) -> None:
    kind = _value_type(kind)
    if not (_is_number(kind) or pa.types.is_boolean(kind)):
        raise ColumnFormatError(f"{key}: a dense column must be float, integer, decimal or boolean, not {kind}")


def _labels(table: pa.Table, columns: Sequence[tuple[str, str, str]], where: str, first_row: int, in_part: int,
            policy: BadLinePolicy) -> tuple[np.ndarray, np.ndarray]:
    """float32 (rows, columns) labels (the weights last, with a weight column) and the mask of good rows (every
    value present and of its kind: `_binary` or `_finite`)."""
    out = np.zeros((table.num_rows, len(columns)), np.float32)
    good = np.ones(table.num_rows, bool)
    for t, (key, name, kind) in enumerate(columns):
        column = _decoded(table.column(name))
        _check_label_type(column.type, f"{where}: {key}")
        if pa.types.is_boolean(column.type) or pa.types.is_float16(column.type):  # no comparison kernels
            column = pc.cast(column, pa.int8() if pa.types.is_boolean(column.type) else pa.float32())
        values, ok, wanted = _binary(column) if kind == "binary" else _finite(column, kind == "weight")
        if policy is BadLinePolicy.ERROR and not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            value = column[i].as_py()
            what = "null" if value is None else f"{value}, not {wanted}"
            raise RowError(f"{where}, row {in_part + i} (file row {first_row + i}): "
                           f"{'weight' if kind == 'weight' else 'label'} column {name!r} is {what}")
        out[:, t] = values
        good &= ok
    return out, good


def _binary(column) -> tuple[np.ndarray, np.ndarray, str]:
    """A binary label: each value compared in its own type (no cast that could fail or round: an int64 above
    2**24 is not 1)."""
    one = pc.equal(column, pa.scalar(1, column.type)).fill_null(False).to_numpy(zero_copy_only=False)
    zero = pc.equal(column, pa.scalar(0, column.type)).fill_null(False).to_numpy(zero_copy_only=False)
    return one, one | zero, "0 or 1"


def _finite(column, weight: bool) -> tuple[np.ndarray, np.ndarray, str]:
    """A regression label (finite as float32) or a weight (also >= 0); nulls are bad rows."""
    if pa.types.is_decimal(column.type):
        column = pc.cast(column, pa.float64())
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls read NaN
    with np.errstate(over="ignore", invalid="ignore"):
        values = values.astype(np.float32)
        ok = np.isfinite(values) & (values >= 0 if weight else True)
    return np.where(ok, values, 0.0).astype(np.float32), ok, "a finite number >= 0" if weight else "a finite number"


def _dense(table: pa.Table, spec: ColumnSpec, where: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 (rows, dense columns), each column transformed, and which of their values are finite, as stored
    and after the transform and the cast to float32."""
    out = np.zeros((table.num_rows, len(spec.dense)), np.float32)
    finite = np.ones((table.num_rows, len(spec.dense)), bool)
    for j, name in enumerate(spec.dense):
        column = _decoded(table.column(name))
        _check_dense_type(column.type, f"{where}: data.dense_columns ({name})")
        if pa.types.is_boolean(column.type):
            column = pc.cast(column, pa.int8())
        values = pc.cast(column, pa.float64(), safe=False).fill_null(0.0).to_numpy(zero_copy_only=False)
        ok = np.isfinite(values)
        if spec.transform(j) == "log1p":
            values = np.log1p(np.maximum(values, 0.0))
        with np.errstate(over="ignore", invalid="ignore"):
            out[:, j] = values
        finite[:, j] = ok & np.isfinite(out[:, j])
    return out, finite
def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _check_list_kind(feature: FeatureColumn, kind: pa.DataType, is_list: bool, key: str) -> None:
    if feature.kind == FeatureKind.SCALAR and is_list:
        raise ColumnFormatError(f"{key}: a list column ({kind}) where a scalar is configured; set kind: list")
    if feature.kind == FeatureKind.LIST and not is_list:
        raise ColumnFormatError(f"{key}: kind list needs a list column, not {kind}")


def _is_text(kind: pa.DataType) -> bool:
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind) or pa.types.is_string_view(kind) or pa.types.is_binary_view(kind))


def _check_id_type(kind: pa.DataType, key: str) -> None:
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or _is_text(kind)):
        raise ColumnFormatError(f"{key}: IDs must be integers or strings, not {kind}")


def _bag(column: pa.ChunkedArray, feature: FeatureColumn, where: str) -> tuple[Bag, np.ndarray]:
    """The feature's IDs as a bag per row, and which rows were truncated to max_len."""
    column = _decoded(column)
    kind = column.type
    is_list = _is_list(kind)
    key = f"{where}: {feature.key}, column {feature.column!r}"
    _check_list_kind(feature, kind, is_list, key)
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    group_hi = np.uint64(feature.group << GROUP_SHIFT)
    if not is_list:
        ids, present = _ids(array, group_hi, key)
        return Bag.from_column(ids, present), np.zeros(len(array), bool)
    lengths = pc.list_value_length(array).fill_null(0).to_numpy().astype(np.int64)
    ids, present = _ids(_decoded(pc.list_flatten(array)), group_hi, key)
    return Bag.from_lengths(ids, lengths, present).keep_last(feature.max_len)  # null elements, "" add nothing


def _ids(array: pa.Array, group_hi: np.uint64, key: str) -> tuple[np.ndarray, np.ndarray]:
    """uint64 IDs and presence of an integer, whole-number float or string array (no Python loop over values,
    no cast that can fail)."""
    kind = array.type
    _check_id_type(kind, key)
    present = array.is_valid().to_numpy(zero_copy_only=False).copy()
    out = np.empty(len(array), np.uint64)
    if pa.types.is_integer(kind):
        hash_ints(_int_bits(array), group_hi, out)
    elif pa.types.is_floating(kind):
        hash_ints(_whole_numbers(array, present, key), group_hi, out)
    else:
        if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):
            array = pc.cast(array, pa.large_binary())
            kind = array.type
        large = pa.types.is_large_string(kind) or pa.types.is_large_binary(kind)
        _, offsets_buf, data_buf = array.buffers()[:3]
        offsets = np.frombuffer(offsets_buf, np.int64 if large else np.int32)[array.offset:array.offset + len(array) + 1]
        data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        if len(offsets) != len(array) + 1 or (bad := hash_strings(data, offsets, group_hi, out, present)) >= 0:
            raise ColumnFormatError(f"{key}: string offsets outside the column's data (at row "
                                    f"{bad if len(offsets) == len(array) + 1 else 0}): a corrupt column")
    return out, present


def _int_bits(array: pa.Array) -> np.ndarray:
    """An integer array's values as int64 bits: signed widths widened (always exact), unsigned ones as uint64
    viewed as int64, so uint64 values of 2**63 and more hash by their bits instead of failing a cast."""
    filled = array.fill_null(0)
    if pa.types.is_signed_integer(array.type):
        return pc.cast(filled, pa.int64()).to_numpy()
    return pc.cast(filled, pa.uint64()).to_numpy().view(np.int64)


def _whole_numbers(array: pa.Array, present: np.ndarray, key: str) -> np.ndarray:
    """A float array of whole numbers as int64 (NaN absent, as null): pandas writes an integer column with
    missing values as float64. A fraction or an infinity is refused, naming the first."""
    values = pc.cast(array, pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
    nan = np.isnan(values)
    present &= ~nan
    values = np.where(nan, 0.0, values)
    bad = (values != np.trunc(values)) | (np.abs(values) >= 2.0 ** 63)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ColumnFormatError(f"{key}: a float ID column must hold whole numbers (row {i} is {values[i]}); "
                                f"write IDs as integers or strings")
    return values.astype(np.int64)
