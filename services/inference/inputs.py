"""Turn the inputs of an inference request into the model's inputs: the features as `KeyedBags` of IDs, and dense.

Three ways to send samples (docs/serving.md#inference-service):

* by feature name, as the training config names the features: a scalar
  feature is one tensor of shape [batch] (INT64, INT32 or UINT64 integers,
  or BYTES strings); a multi-hot or sequence feature (`kind: list`) is its
  flat values (same datatypes, shape [nnz]) plus `NAME__lengths` (INT32 or
  INT64, [batch]: how many values each sample has, in order; a scalar feature
  may be sent that way too, with lengths of 0 or 1). Integers and strings are
  hashed exactly as the training reader hashes a Parquet column (an empty
  string is absent); a list longer than the feature's `max_len` keeps its
  last (most recent) `max_len` values, as in training, and is counted
  (`truncated_rows_total`). With them, `dense`, FP32 [batch, num_dense]: the
  dense features after the loader's transform.

* `rows`, BYTES (batch,): Criteo TSV lines as in the training data, with or
  without the leading label column (39 or 40 tab-separated fields; a label is
  ignored). Parsed and hashed by the training data loader's own kernels
  (`hybridrec.core.layouts.criteo_kernels`), so serving cannot drift from training.
* `ids`, UINT64 or INT64 (batch, num_features): hashed IDs as the data loader
  makes them (feature group in the top 8 bits, `hybridrec.core.wire.ids`), one column per
  bundle feature in manifest order; an ID whose low 56 bits are 0 (the
  reserved `group << 56` of an empty field) is absent. With it, `dense`, FP32
  (batch, num_dense): the dense features after the loader's transform
  (log1p of max(x, 0)).

Anything else is refused with `BadInput` (INVALID_ARGUMENT / 400) naming
what is wrong. Every form gives the same `Samples`: the features as one
`hybridrec.core.wire.jagged.KeyedBags` (a Criteo column is a bag of at most one ID).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hybridrec.core.runtime import rpc
from hybridrec.core.layouts.bundle import BundleManifest
from hybridrec.core.layouts.criteo_format import NUM_DENSE, NUM_FIELDS, NUM_SPARSE, feature_columns
from hybridrec.core.config import FeatureKind
from hybridrec.core.layouts.criteo_kernels import _OK, _parse_lines, error_text, hash_ints, hash_strings, join_rows
from hybridrec.core.wire.ids import GROUP_SHIFT, VALUE_MASK
from hybridrec.core.wire.jagged import Bag, KeyedBags
from services.inference.byte_elements import ByteElements

DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}
"""OIP datatype -> numpy dtype (BYTES elements are `ByteElements`)."""


class BadInput(ValueError):
    """A request the model cannot answer: INVALID_ARGUMENT / HTTP 400 with this message."""


class NotFound(rpc.NotFound):
    """An unknown model or version: NOT_FOUND / HTTP 404."""


class NotReady(rpc.Unavailable):
    """The model is still loading: UNAVAILABLE / HTTP 503 (retry)."""


@dataclass
class Tensor:
    """One input tensor as a transport decoded it: numeric data as a flat numpy array, BYTES as `ByteElements`
    (or a list of bytes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | ByteElements | list[bytes]


LENGTHS_SUFFIX = "__lengths"
"""`NAME__lengths`: the per-sample value counts of a feature sent as flat values."""
ID_DATATYPES = ("INT64", "INT32", "UINT64", "BYTES")


class Samples:
    """One request's (or one micro-batch's) samples: every feature as `KeyedBags` in manifest order, and dense.

    Samples that came as columns (`rows`, `ids`: one ID or none per feature) keep them, and their bags are
    made only when asked for: a model of scalar features of one width looks the columns up as they are
    (`LoadedModel.forward_columns`) and never needs bags, which cost a batch-1 request several microseconds."""

    __slots__ = ("_bags", "dense", "columns")

    def __init__(self, bags: KeyedBags | None, dense: np.ndarray,
                 columns: tuple[np.ndarray, np.ndarray] | None = None):
        if bags is None and columns is None:
            raise ValueError("Samples need bags or columns")
        self._bags = bags
        self.dense = dense  # float32 (n, num_dense)
        self.columns = columns
        """(ids (n, F), present (n, F)) when every feature came as one ID or none per sample."""

    @property
    def bags(self) -> KeyedBags:
        if self._bags is None:
            self._bags = KeyedBags.from_columns(*self.columns)
        return self._bags

    def __len__(self) -> int:
        return self.dense.shape[0]

    @staticmethod
    def from_columns(ids: np.ndarray, present: np.ndarray, dense: np.ndarray) -> "Samples":
        return Samples(None, dense, (ids, present))

    @staticmethod
    def concat(parts: Sequence["Samples"]) -> "Samples":
        if len(parts) == 1:
            return parts[0]
        dense = np.concatenate([p.dense for p in parts])
        if all(p.columns is not None for p in parts):
            return Samples(None, dense, (np.concatenate([p.columns[0] for p in parts]),
                                         np.concatenate([p.columns[1] for p in parts])))
        return Samples(KeyedBags.concat([p.bags for p in parts]), dense)


def elements_of(t: Tensor) -> ByteElements:
    """A BYTES tensor's elements as one buffer (a transport's `ByteElements`, or a list of bytes)."""
    return t.data if isinstance(t.data, ByteElements) else ByteElements.of(t.data)


def _utf8(rows: ByteElements) -> bool:
    """Whether every row is UTF-8: the whole buffer is, and no row starts inside another's character (with a
    continuation byte)."""
    try:
        rows.data.tobytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    starts = rows.offsets[:-1][rows.lengths > 0]
    return not ((rows.data[starts] & 0xC0) == 0x80).any()


def _row_error(rows: ByteElements) -> None:
    """BadInput naming the first row that is not UTF-8, holds a line break or has a wrong number of fields (one
    row at a time: only for a request that has one)."""
    for i in range(len(rows)):
        row = rows[i]
        try:
            row.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"rows[{i}] is not UTF-8: {exc.reason} at byte {exc.start}") from None
        if b"\n" in row or b"\r" in row:
            raise BadInput(f"rows[{i}] holds a line break: send one sample per element")
        tabs = row.count(b"\t")
        if tabs not in (NUM_FIELDS - 2, NUM_FIELDS - 1):
            raise BadInput(f"rows[{i}]: expected {NUM_FIELDS - 1} tab-separated fields (or {NUM_FIELDS} with "
                           f"the label first), got {tabs + 1}")
    raise AssertionError("_row_error found no bad row")


class InputDecoder:
    """Validates a request's tensors against one bundle's features and makes `Samples`."""

    def __init__(self, manifest: BundleManifest, max_rows: int):
        self.features = manifest.features
        self.num_dense = manifest.num_dense
        self.input_types = manifest.input_types
        self.dense_columns = list(manifest.dense_columns)
        self.max_rows = max_rows
        self.groups = np.array([f.group for f in self.features], np.uint64)
        # Raw rows: the Criteo column of each feature and the group prefix of every column,
        # as the data loader sets them up (a feature that is not a C column makes raw rows unusable).
        self.columns: np.ndarray | None = None
        self.row_error = ""
        groups = list(range(NUM_SPARSE))
        try:
            columns, groups = feature_columns(self.features)
        except ValueError as exc:
            self.row_error = str(exc)
        else:
            if self.num_dense != NUM_DENSE:
                self.row_error = f"the model takes {self.num_dense} dense features, Criteo rows have {NUM_DENSE}"
            else:
                self.columns = np.asarray(columns, np.int64)
        self.group_hi = np.array([g << GROUP_SHIFT for g in groups], np.uint64)

        self.truncated_rows = 0  # list values past a feature's max_len, cut as in training (rows cut)

    def metadata(self) -> list[dict]:
        """Every input this model takes, for the model metadata: the dense matrix and each feature by name
        (its datatype as the training data held it; BYTES where the bundle does not say), a list feature with
        its lengths; then `ids`, and `rows` when the model reads Criteo columns. -1: a batch or ragged size."""
        inputs = [{"name": "dense", "datatype": "FP32", "shape": [-1, self.num_dense]}]
        inputs += [{"name": name, "datatype": "FP32", "shape": [-1]} for name in self.dense_columns]
        for f in self.features:
            inputs.append({"name": f.name, "datatype": self.input_types.get(f.name, "BYTES"), "shape": [-1]})
            if f.kind == FeatureKind.LIST:
                inputs.append({"name": f.name + LENGTHS_SUFFIX, "datatype": "INT64", "shape": [-1]})
        inputs.append({"name": "ids", "datatype": "UINT64", "shape": [-1, len(self.features)]})
        if self.columns is not None:
            inputs.append({"name": "rows", "datatype": "BYTES", "shape": [-1]})
        return inputs

    def input_names(self) -> str:
        return ("'rows' (BYTES), or 'ids' (UINT64/INT64) with 'dense' (FP32), or one input per feature "
                f"({', '.join(f.name for f in self.features)}; a list feature with NAME{LENGTHS_SUFFIX}) with "
                "'dense' (FP32)" + (f" or the dense columns ({', '.join(self.dense_columns)}, FP32 each)"
                                    if self.dense_columns else ""))

    def decode(self, tensors: Sequence[Tensor]) -> Samples:
        by_name: dict[str, Tensor] = {}
        for t in tensors:
            if t.name in by_name:
                raise BadInput(f"input {t.name!r} given twice")
            by_name[t.name] = t
        names = set(by_name)
        if names == {"rows"}:
            samples = self._rows(by_name["rows"])
        elif names == {"ids", "dense"}:
            samples = self._ids(by_name["ids"], by_name["dense"])
        elif names - {"rows", "ids"} and not names & {"rows", "ids"}:
            samples = self._named(by_name)
        else:
            extra = sorted(names - {"rows", "ids", "dense"})
            raise BadInput(f"inputs {sorted(names)}: expected {self.input_names()}"
                           + (f"; unknown input(s) {extra}" if extra else ""))
        if len(samples) == 0:
            raise BadInput("the request holds no samples (batch 0)")
        return samples

    def _check_rows(self, n: int) -> None:
        if n > self.max_rows:
            raise BadInput(f"{n} samples in one request; the maximum is {self.max_rows} (max_request_rows)")

    def _rows(self, t: Tensor) -> Samples:
        if t.datatype != "BYTES":
            raise BadInput(f"input 'rows' must be BYTES, got {t.datatype}")
        if len(t.shape) not in (1, 2) or (len(t.shape) == 2 and t.shape[1] != 1):
            raise BadInput(f"input 'rows' must have shape [batch] or [batch, 1], got {list(t.shape)}")
        if self.columns is None:
            raise BadInput(f"this model cannot take raw rows: {self.row_error}; send 'ids' and 'dense'")
        rows = elements_of(t)
        n = len(rows)
        self._check_rows(n)
        buf = np.empty(rows.data.shape[0] + 3 * n, np.uint8)
        end, bad, non_ascii = join_rows(rows.data, rows.offsets, buf)
        if bad >= 0 or (non_ascii and not _utf8(rows)):
            _row_error(rows)  # raises, naming the first bad row
        labels = np.empty(n, np.float32)
        dense = np.empty((n, NUM_DENSE), np.float32)
        ids = np.empty((n, NUM_SPARSE), np.uint64)
        present = np.empty((n, NUM_SPARSE), np.bool_)
        at, parsed, _, _, _, _, code, detail = _parse_lines(buf, 0, end, True, self.group_hi, labels, dense, ids,
                                                            present, 0, n, True, True)
        if code != _OK:  # `at`: where the bad row's line starts in buf, as the kernel read it
            line = buf[at:end].tobytes().split(b"\n", 1)[0]
            raise BadInput(f"rows[{parsed}]: {error_text(line, code, detail)}")
        return Samples.from_columns(ids[:, self.columns], present[:, self.columns], dense)

    def _ids(self, ids_t: Tensor, dense_t: Tensor) -> Samples:
        nf = len(self.features)
        if ids_t.datatype not in ("UINT64", "INT64"):
            raise BadInput(f"input 'ids' must be UINT64 or INT64, got {ids_t.datatype}")
        if dense_t.datatype != "FP32":
            raise BadInput(f"input 'dense' must be FP32, got {dense_t.datatype}")
        if len(ids_t.shape) != 2 or ids_t.shape[1] != nf:
            raise BadInput(f"input 'ids' must have shape [batch, {nf}] (one column per feature: "
                           f"{', '.join(f.name for f in self.features)}), got {list(ids_t.shape)}")
        n = ids_t.shape[0]
        if list(dense_t.shape) != [n, self.num_dense]:
            raise BadInput(f"input 'dense' must have shape [{n}, {self.num_dense}], got {list(dense_t.shape)}")
        self._check_rows(n)
        ids = np.asarray(ids_t.data).view(np.uint64).reshape(n, nf)
        dense = np.asarray(dense_t.data, np.float32).reshape(n, self.num_dense)
        if not np.isfinite(dense).all():
            raise BadInput("input 'dense' holds NaN or infinity")
        groups = ids >> np.uint64(GROUP_SHIFT)
        wrong = groups != self.groups[None, :]
        if wrong.any():
            r, f = (int(x[0]) for x in np.nonzero(wrong))
            raise BadInput(f"ids[{r}, {f}] = {int(ids[r, f])} is of feature group {int(groups[r, f])}; feature "
                           f"{self.features[f].name} is group {int(self.groups[f])} (the top 8 bits of an ID, "
                           "hybridrec.core.wire.ids)")
        present = (ids & np.uint64(VALUE_MASK)) != 0
        return Samples.from_columns(ids, present, dense)

    # -- by feature name ---------------------------------------------------------------------------
    def _named(self, by_name: dict[str, Tensor]) -> Samples:
        columns_given = sorted(set(self.dense_columns) & set(by_name))
        if columns_given and "dense" in by_name:
            raise BadInput(f"the dense features are given twice: as 'dense' and as the dense columns "
                           f"{columns_given}; send one form, 'dense' (FP32 [batch, {self.num_dense}]) or every "
                           f"column ({', '.join(self.dense_columns)}, FP32 each)")
        by_column = bool(columns_given)
        dense_names = self.dense_columns if by_column else ["dense"]
        lengths_names = {f.name + LENGTHS_SUFFIX for f in self.features}
        unknown = sorted(set(by_name) - set(dense_names) - {f.name for f in self.features} - lengths_names)
        if unknown:
            raise BadInput(f"unknown input(s) {unknown}: this model takes {self.input_names()}")
        missing = [name for name in [*dense_names, *(f.name for f in self.features)] if name not in by_name]
        if missing:
            raise BadInput(f"missing input(s) {missing}: this model takes {self.input_names()}")
        dense = self._dense_columns(by_name) if by_column else self._dense_matrix(by_name["dense"])
        n = dense.shape[0]  # checked against max_rows by either reader of the dense inputs
        if not np.isfinite(dense).all():
            raise BadInput("the dense inputs hold NaN or infinity")
        bags = [self._feature(f, by_name[f.name], by_name.get(f.name + LENGTHS_SUFFIX), n) for f in self.features]
        return Samples(KeyedBags.from_bags(bags), dense)

    def _dense_matrix(self, t: Tensor) -> np.ndarray:
        if t.datatype != "FP32":
            raise BadInput(f"input 'dense' must be FP32, got {t.datatype}")
        if len(t.shape) != 2 or t.shape[1] != self.num_dense:
            raise BadInput(f"input 'dense' must have shape [batch, {self.num_dense}], got {list(t.shape)}")
        self._check_rows(t.shape[0])
        return np.asarray(t.data, np.float32).reshape(t.shape[0], self.num_dense)

    def _dense_columns(self, by_name: dict[str, Tensor]) -> np.ndarray:
        """One FP32 [batch] input per dense column, in the model's order."""
        first = by_name[self.dense_columns[0]]
        n = int(first.shape[0]) if first.shape else 0
        self._check_rows(n)
        columns = []
        for name in self.dense_columns:
            t = by_name[name]
            if t.datatype != "FP32":
                raise BadInput(f"input {name!r} must be FP32, got {t.datatype}")
            if list(t.shape) not in ([n], [n, 1]):
                raise BadInput(f"input {name!r} must have shape [{n}] (one value per sample, as "
                               f"{self.dense_columns[0]!r}), got {list(t.shape)}")
            columns.append(np.asarray(t.data, np.float32).reshape(n))
        return np.stack(columns, axis=1) if columns else np.zeros((n, 0), np.float32)

    def _feature(self, feature, values: Tensor, lengths_t: Tensor | None, n: int) -> Bag:
        """One feature's bag from its values (and lengths), hashed as the training reader hashes them."""
        name = feature.name
        if values.datatype not in ID_DATATYPES:
            raise BadInput(f"input {name!r} must be one of {', '.join(ID_DATATYPES)}, got {values.datatype}")
        if len(values.shape) != 1 and not (len(values.shape) == 2 and values.shape[1] == 1):
            raise BadInput(f"input {name!r} must be flat ([batch], or [n] values with {name}{LENGTHS_SUFFIX}), "
                           f"got shape {list(values.shape)}")
        count = int(values.shape[0])
        if lengths_t is None:
            if feature.kind == FeatureKind.LIST:
                raise BadInput(f"input {name!r} is a list feature: send its flat values with "
                               f"{name}{LENGTHS_SUFFIX} (INT32/INT64, [batch])")
            if count != n:
                raise BadInput(f"input {name!r} has {count} values for a batch of {n}")
            lengths = np.ones(n, np.int64)
        else:
            lengths = self._lengths(name, lengths_t, n, count)
            if feature.kind != FeatureKind.LIST and lengths.size and int(lengths.max()) > 1:
                raise BadInput(f"input {name}{LENGTHS_SUFFIX}: {name} is a scalar feature (0 or 1 value per "
                               f"sample), got a length of {int(lengths.max())}")
        ids, present = self._hash(values, feature.group)
        bag = Bag.from_lengths(ids, lengths, present)  # empty strings add nothing, as in the reader
        if feature.kind == FeatureKind.LIST:
            bag, cut = bag.keep_last(feature.max_len)
            self.truncated_rows += int(cut.sum())
        return bag

    @staticmethod
    def _lengths(name: str, t: Tensor, n: int, count: int) -> np.ndarray:
        key = name + LENGTHS_SUFFIX
        if t.datatype not in ("INT32", "INT64"):
            raise BadInput(f"input {key!r} must be INT32 or INT64, got {t.datatype}")
        if list(t.shape) not in ([n], [n, 1]):
            raise BadInput(f"input {key!r} must have shape [{n}] (one length per sample), got {list(t.shape)}")
        lengths = np.asarray(t.data).astype(np.int64).reshape(n)
        if (lengths < 0).any():
            raise BadInput(f"input {key!r} holds a negative length ({int(lengths.min())})")
        if int(lengths.sum()) != count:
            raise BadInput(f"input {key!r}: the lengths add up to {int(lengths.sum())}, but {name!r} has {count} "
                           "values")
        return lengths

    @staticmethod
    def _hash(t: Tensor, group: int) -> tuple[np.ndarray, np.ndarray | None]:
        """uint64 IDs of integer or string values, and which are there (an empty string is not; None: all)."""
        group_hi = np.uint64(group << GROUP_SHIFT)
        count = int(t.shape[0])
        out = np.empty(count, np.uint64)
        if t.datatype == "BYTES":
            elements = elements_of(t)
            present = np.ones(count, np.bool_)
            if hash_strings(elements.data, elements.offsets, group_hi, out, present) >= 0:  # checked when split
                raise BadInput(f"input {t.name!r}: string offsets outside its data")
            return out, present
        values = np.asarray(t.data).reshape(count)
        hash_ints(values.view(np.int64) if values.dtype == np.uint64 else values.astype(np.int64), group_hi, out)
        return out, None  # every integer is there
