"""Data as users write it, read by the data loader's own readers (services/dataloader/columns.py, parquet.py,
tsv.py, prepared.py): a pandas-written Parquet of the synthetic Criteo data gives the TSV's very batches with
`data.dense_transform: log1p`; IDs of every integer width and sign (uint64 over all 2**64 values), whole-number
floats and dictionaries; labels of any type and range; dense columns of every number type; NaN and infinities
under `data.non_finite` in TSV, Parquet and prepared data, refused naming file, row and column or skipped and
counted per file. Spark's conventions (NaN for missing doubles, int32 and decimal columns, `element` lists) are
written with pyarrow as Spark writes them."""
from __future__ import annotations

import decimal
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.app.data.synth import synthesize
from hybridrec.core.config import ConfigError, from_dict
from hybridrec.core.layouts.criteo_format import DENSE_COLUMNS, SPARSE_COLUMNS
from hybridrec.core.layouts.criteo_kernels import hash_ints
from hybridrec.core.wire.ids import GROUP_SHIFT
from services.dataloader import prepared, prepared_write
from services.dataloader.batching import ReadCounters
from services.dataloader.parquet import ParquetFormatError, ParquetSpec, read_parquet
from services.dataloader.sources import check_first_rows, eval_rows, train_batches
from services.dataloader.tsv import CriteoFormatError, read_criteo
from tests.unit.test_parquet import _same_sparse

NAMES = ["label", *DENSE_COLUMNS, *SPARSE_COLUMNS]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("own")
    synthesize(out, rows=6_000, eval_rows=2_000, seed=5)
    return out


def pandas_parquet(tsv, out, *, uint64_c1: bool = False):
    """What most users do: pandas reads the TSV (a count column without missing values is int64, one with them
    float64 holding NaN, a token column str) and writes Parquet (NaN as null)."""
    frame = pd.read_csv(tsv, sep="\t", names=NAMES)
    if uint64_c1:  # a 64-bit hash of the token, as any 64-bit hash gives: half of them >= 2**63
        codes = pd.util.hash_pandas_object(frame["C1"].fillna(""), index=False).to_numpy(np.uint64)
        frame["C1"] = codes
    frame.to_parquet(out)
    return out


def _config(train, num_dense: int | None = None, **data):
    fmt = "parquet" if str(train).endswith(".parquet") else "tsv"
    num_dense = num_dense or len(data.get("dense_columns") or DENSE_COLUMNS)
    return from_dict({"data": {"train": [str(train)], "format": fmt, **data}, "num_dense": num_dense,
                      "training": {"batch_size": 1000}})


def test_a_pandas_written_parquet_gives_the_tsv_batches_with_log1p(synth, tmp_path):
    path = pandas_parquet(synth / "train.tsv", tmp_path / "train.parquet")
    schema = pq.read_schema(path)
    kinds = {str(schema.field(c).type) for c in DENSE_COLUMNS}
    assert {"int64", "double"} <= kinds, kinds  # what pandas writes: integers, and floats where one is missing
    assert pq.read_table(path, columns=["I3"]).column(0).null_count > 0
    tsv = list(train_batches(_config(synth / "train.tsv"), ReadCounters()))
    par = list(train_batches(_config(path, dense_transform="log1p"), ReadCounters()))
    assert len(tsv) == len(par) == 6
    for (a, _), (b, _) in zip(tsv, par):
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.dense, b.dense)
        _same_sparse(a, b)
    raw = list(train_batches(_config(path), ReadCounters()))  # `none`: the counts as stored
    assert raw[0][0].dense.max() > 100 > par[0][0].dense.max()


def test_uint64_ids_over_all_64_bits_train_and_keep_the_ids_below_2_63(synth, tmp_path):
    path = pandas_parquet(synth / "train.tsv", tmp_path / "u.parquet", uint64_c1=True)
    column = pq.read_table(path, columns=["C1"]).column(0)
    assert column.type == pa.uint64() and int(pa.compute.max(column).as_py()) >= 2 ** 63
    batches = list(train_batches(_config(path, dense_transform="log1p"), ReadCounters()))
    assert sum(len(rows) for rows, _ in batches) == 6_000
    ids = np.concatenate([rows.bags.bag(0).values for rows, _ in batches])
    assert len(np.unique(ids)) == len(np.unique(column.to_numpy()))  # distinct hashes stay distinct
    # A value below 2**63 has the ID it has as int64, whatever the width and sign of its column.
    values = [0, 1, 7, 2 ** 31 - 1, 2 ** 40, 2 ** 63 - 1]
    expected = np.empty(len(values), np.uint64)
    hash_ints(np.array(values, np.int64), np.uint64(0), expected)
    spec = ParquetSpec.from_config(_config("x.parquet", dense_columns=["d"], labels=["y"]))
    for kind in (pa.uint64(), pa.int64()):
        got = _ids(tmp_path, pa.array(values, kind), spec)
        np.testing.assert_array_equal(got, expected)
    small = [v for v in values if v < 2 ** 7]
    for kind in (pa.int8(), pa.uint8(), pa.int16(), pa.uint16(), pa.int32(), pa.uint32()):
        np.testing.assert_array_equal(_ids(tmp_path, pa.array(small, kind), spec), expected[:len(small)])
    top = _ids(tmp_path, pa.array([2 ** 63, 2 ** 64 - 1], pa.uint64()), spec)
    assert len(set(top.tolist()) | set(expected.tolist())) == len(values) + 2
    neg = _ids(tmp_path, pa.array([-1, -(2 ** 63)], pa.int64()), spec)  # the same 64 bits as 2**64 - 1 and 2**63
    np.testing.assert_array_equal(neg, top[::-1])


def _ids(tmp_path, column: pa.Array, spec: ParquetSpec) -> np.ndarray:
    """The IDs of one scalar ID column as the reader makes them (feature group 0)."""
    n = len(column)
    path = tmp_path / "one_column.parquet"
    pq.write_table(pa.table({"y": pa.array([1] * n), "d": pa.array([0.0] * n), "C1": column}), path)
    (chunk,) = read_parquet(path, _one_feature(spec), chunk_rows=n)
    return chunk.rows.bags.bag(0).values


def _one_feature(spec_or_config) -> ParquetSpec:
    """The spec with feature C1 alone (the default config's 26 features want 26 columns)."""
    spec = spec_or_config if isinstance(spec_or_config, ParquetSpec) else ParquetSpec.from_config(spec_or_config)
    return ParquetSpec(spec.labels, spec.dense, spec.features[:1], spec.transforms)


def test_whole_float_dictionary_and_nullable_ids_are_read_as_their_values(tmp_path):
    spec = ParquetSpec.from_config(_config("x.parquet", dense_columns=["d"], labels=["y"]))
    ints = _ids(tmp_path, pa.array([5, 6, 7], pa.int64()), spec)
    # pandas writes an integer column with a missing value as float64; NaN is absent
    np.testing.assert_array_equal(_ids(tmp_path, pa.array([5.0, np.nan, 6.0, 7.0]), spec), ints)
    np.testing.assert_array_equal(_ids(tmp_path, pa.array([5, None, 6, 7], pa.int64()), spec), ints)
    cats = pd.Series(["a", "b", "a"], dtype="category")
    dictionary = pa.Array.from_pandas(cats)
    assert pa.types.is_dictionary(dictionary.type)
    np.testing.assert_array_equal(_ids(tmp_path, dictionary, spec), _ids(tmp_path, pa.array(["a", "b", "a"]), spec))
    with pytest.raises(ParquetFormatError, match=r"a float ID column must hold whole numbers \(row 1 is 2.5\)"):
        _ids(tmp_path, pa.array([1.0, 2.5]), spec)


def test_labels_of_any_type_and_range_hold_0_or_1(tmp_path):
    spec = _one_feature(_config("x.parquet", dense_columns=["d"], labels=["y"]))
    for labels in (pa.array([True, False, True]), pa.array([1, 0, 1], pa.uint64()), pa.array([1.0, 0.0, 1.0]),
                   pa.array([1, 0, 1], pa.int8()), pa.array([1, 0, 1]).dictionary_encode(),
                   pa.array(np.array([1, 0, 1], np.float16)), pa.array([1, 0, 1], pa.decimal128(5, 0))):
        pq.write_table(pa.table({"y": labels, "d": pa.array([0.5] * 3), "C1": pa.array(["t"] * 3)}),
                       tmp_path / "l.parquet")
        (chunk,) = read_parquet(tmp_path / "l.parquet", spec, chunk_rows=3)
        np.testing.assert_array_equal(chunk.rows.labels, [1, 0, 1])
    # 2**24 + 1 is not 1, though float32 would round it to 2**24; 2**40 is a bad label, not an error of the cast
    big = pa.array([1, 2 ** 24 + 1, 2 ** 40, 0], pa.int64())
    pq.write_table(pa.table({"y": big, "d": pa.array([0.5] * 4), "C1": pa.array(["t"] * 4)}), tmp_path / "b.parquet")
    (chunk,) = read_parquet(tmp_path / "b.parquet", spec, chunk_rows=4)
    assert len(chunk) == 2 and chunk.num_bad_rows == 2
    with pytest.raises(ParquetFormatError, match=r"row 1 \(file row 1\): label column 'y' is 16777217, not 0 or 1"):
        list(read_parquet(tmp_path / "b.parquet", spec, chunk_rows=4, bad_lines="error"))


def test_dense_columns_of_every_number_type(tmp_path):
    config = _config("x.parquet", labels=["y"], dense_columns=["f", "i", "u", "b", "dec", "h"],
                     dense_transform={"i": "log1p"})
    values = {"f": pa.array([1.5, None]), "i": pa.array([np.e - 1, None]).cast(pa.float32()).cast(pa.int64(), safe=False),
              "u": pa.array([3, 4], pa.uint64()), "b": pa.array([True, None]),
              "dec": pa.array([decimal.Decimal("2.25"), decimal.Decimal("-1")], pa.decimal128(10, 2)),
              "h": pa.array([np.float16(0.5), np.float16(2)], pa.float16())}
    pq.write_table(pa.table({"y": pa.array([0, 1]), **values, "C1": pa.array(["t", "u"])}), tmp_path / "d.parquet")
    (chunk,) = read_parquet(tmp_path / "d.parquet", _one_feature(config), chunk_rows=2)
    np.testing.assert_allclose(chunk.rows.dense, [[1.5, np.log1p(1), 3, 1, 2.25, 0.5], [0, 0, 4, 0, -1, 2]],
                               rtol=1e-6)


def _spark_like(path, *, nan_row: int | None = None, inf_row: int | None = None, big_row: int | None = None):
    """A file as Spark writes it: doubles with NaN (Spark writes NaN, not null, for a missing double), int32
    and decimal columns, `element` lists; two row groups."""
    n = 40
    d0 = np.linspace(0, 1, n)
    if nan_row is not None:
        d0[nan_row] = np.nan
    if inf_row is not None:
        d0[inf_row] = -np.inf
    d1 = np.arange(n, dtype=np.float64)
    if big_row is not None:
        d1[big_row] = 1e39  # finite as a double, past float32's range
    tags = pa.array([[f"t{i}", f"u{i % 3}"] for i in range(n)], pa.list_(pa.field("element", pa.string())))
    table = pa.table({"label": pa.array([i % 2 for i in range(n)], pa.int32()), "d0": pa.array(d0),
                      "d1": pa.array(d1), "d2": pa.array([decimal.Decimal(i) / 4 for i in range(n)], pa.decimal128(9, 2)),
                      "item": pa.array(range(n), pa.int32()), "tags": tags})
    pq.write_table(table, path, row_group_size=20)
    return path


def _spark_config(path, **data):
    return from_dict({"data": {"train": [str(path)], "format": "parquet", "labels": ["label"],
                               "dense_columns": ["d0", "d1", "d2"], **data}, "num_dense": 3,
                      "features": [{"name": "item", "group": 1}, {"name": "tags", "group": 2, "kind": "list"}],
                      "training": {"batch_size": 16}})


def test_nan_and_infinities_stop_naming_file_row_group_row_and_column_or_are_skipped_and_counted(tmp_path):
    path = _spark_like(tmp_path / "spark.parquet", nan_row=3, inf_row=25, big_row=30)
    with pytest.raises(ParquetFormatError, match=r"spark.parquet: row group 0, row 3 \(file row 3\): "
                                                 r"data.dense_columns \(d0\) is nan, not a finite number"):
        list(train_batches(_spark_config(path), ReadCounters()))
    with pytest.raises(ConfigError, match=r"row group 0, row 3 \(file row 3\): data.dense_columns \(d0\) is nan"):
        try:
            check_first_rows(_spark_config(path))  # what check and run read before anything starts
        except ValueError as exc:
            raise ConfigError(str(exc))
    counters = ReadCounters()
    batches = list(train_batches(_spark_config(path, non_finite="skip"), counters))
    assert sum(len(rows) for rows, _ in batches) == 37 and counters.non_finite_rows == 3
    assert counters.non_finite_by_file == {str(path): 3}
    assert all(np.isfinite(rows.dense).all() for rows, _ in batches)
    with pytest.raises(ParquetFormatError, match=r"row group 1, row 10 \(file row 30\): data.dense_columns \(d1\) is "
                                                 r"1e\+39"):
        list(train_batches(_spark_config(_spark_like(tmp_path / "big.parquet", big_row=30)), ReadCounters()))
    # log1p(max(-inf, 0)) would be 0: the value as stored is what counts
    with pytest.raises(ParquetFormatError, match=r"file row 25\): data.dense_columns \(d0\) is -inf"):
        list(train_batches(_spark_config(_spark_like(tmp_path / "inf.parquet", inf_row=25), dense_transform="log1p"),
                           ReadCounters()))


def test_a_tsv_integer_of_309_digits_is_not_finite(synth, tmp_path):
    lines = (synth / "train.tsv").read_bytes().splitlines(keepends=True)[:50]
    fields = lines[7].split(b"\t")
    fields[3] = b"9" * 309
    lines[7] = b"\t".join(fields)
    fields = lines[20].split(b"\t")
    fields[5] = b"-" + b"1" * 400  # a sign does not make it finite
    lines[20] = b"\t".join(fields)
    path = tmp_path / "long.tsv"
    path.write_bytes(b"".join(lines))
    with pytest.raises(CriteoFormatError, match=r"long.tsv:8: column I3 is not finite: an integer of 309 digits"):
        list(read_criteo(path))
    counters = ReadCounters()
    batches = list(train_batches(_config(path, non_finite="skip"), counters))
    assert sum(len(rows) for rows, _ in batches) == 48 and counters.non_finite_by_file == {str(path): 2}
    nine = b"\t".join([*fields[:5], b"9" * 308, *fields[6:]])  # 308 digits: 1e308 is a float64
    (chunk,) = read_criteo(_write(tmp_path / "ok.tsv", nine))
    assert np.isfinite(chunk.dense).all() and chunk.dense[0, 4] == np.float32(np.log1p(1e308 - 1 + 1))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_prepared_data_applies_the_policy_and_a_shard_holding_nan_is_refused_or_skipped(tmp_path):
    path = _spark_like(tmp_path / "spark.parquet", nan_row=3)
    config = _spark_config(path, non_finite="skip")
    manifest = prepared_write.prepare([path], tmp_path / "prep", config)
    assert manifest.shards[0].non_finite_rows == 1 and manifest.shards[0].rows == 39
    counters = ReadCounters()
    prep = _spark_config(tmp_path / "prep", non_finite="skip")
    assert sum(len(r) for r, _ in train_batches(prep, counters)) == 39 and counters.non_finite_by_file == {str(path): 1}
    # A shard that holds a NaN (prepared by a version before the check): refused naming the shard and row
    dense = tmp_path / "prep" / "shard-00000" / "dense.npy"
    array = np.load(dense)
    array[17, 2] = np.nan
    np.save(dense, array)
    entry = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    entry["shards"][0]["files"]["dense.npy"] = {"bytes": dense.stat().st_size, "checksum": prepared.checksum(dense)}
    (tmp_path / "prep" / "manifest.json").write_text(json.dumps(entry))
    with pytest.raises(prepared.PreparedDataError, match=r"shard-00000: row 17: dense column 2 is nan"):
        list(train_batches(_spark_config(tmp_path / "prep"), ReadCounters()))
    counters = ReadCounters()
    batches = list(train_batches(prep, counters))
    assert sum(len(r) for r, _ in batches) == 38 and counters.non_finite_rows == 2
    assert all(np.isfinite(r.dense).all() for r, _ in batches)
    assert all(np.isfinite(r.dense).all() for r in eval_rows(from_dict({**prep.model_dump(mode="json"), "data": {
        **prep.data.model_dump(mode="json"), "eval": [str(tmp_path / "prep")]}}), ReadCounters()))


def test_a_dense_transform_with_tsv_or_an_unknown_column_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"data.dense_transform: 'none': the TSV reader applies log1p"):
        from_dict({"data": {"train": ["x.tsv"], "dense_transform": "none"}})
    with pytest.raises(ConfigError, match=r"data.dense_transform: I99 not among the dense columns"):
        from_dict({"data": {"train": ["x.parquet"], "format": "parquet", "dense_transform": {"I99": "log1p"}}})
    assert _config("x.parquet", dense_transform={"I2": "log1p"}).dense_transforms[:3] == ["none", "log1p", "none"]
