"""The Parquet reader: the same samples as TSV give the same batches; list columns, truncation, bad input."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.core.config import ConfigError, from_dict
from hybridrec.app.data.parquet_data import tsv_to_parquet
from hybridrec.app.data.synth import synthesize
from services.dataloader.batching import ReadCounters
from services.dataloader.parquet import ParquetFormatError, ParquetSpec, read_parquet
from services.dataloader.sources import eval_rows, train_batches


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    s = synthesize(out, rows=12_000, eval_rows=5_000, seed=3)
    # row groups of 2,500 rows: batches of 1,000 span row-group boundaries
    for name in ("train", "eval"):
        tsv_to_parquet(out / f"{name}.tsv", out / f"{name}.parquet", row_group_rows=2_500)
    return out, s


def _configs(out):
    tsv = from_dict({"data": {"train": [str(out / "train.tsv")], "eval": [str(out / "eval.tsv")]},
                     "training": {"batch_size": 1000}})
    par = from_dict({"data": {"train": [str(out / "train.parquet")], "eval": [str(out / "eval.parquet")],
                              "format": "parquet"}, "training": {"batch_size": 1000}})
    return tsv, par


def _same_sparse(a, b):
    sa, sb = a.sparse("train"), b.sparse("train")
    assert sa.batch_size == sb.batch_size
    for ua, ub in zip(sa.uniq, sb.uniq):
        np.testing.assert_array_equal(ua, ub)
    np.testing.assert_array_equal(sa.bags.values, sb.bags.values)
    np.testing.assert_array_equal(sa.bags.lengths, sb.bags.lengths)
    assert sa.encode() == sb.encode()  # the very bytes the embedding worker receives


def test_tsv_and_parquet_give_identical_batches(criteo):
    out, _ = criteo
    tsv, par = _configs(out)
    a = list(train_batches(tsv, ReadCounters()))
    b = list(train_batches(par, ReadCounters()))
    assert len(a) == len(b) == 12
    for (ra, _), (rb, _) in zip(a, b):
        np.testing.assert_array_equal(ra.labels, rb.labels)
        np.testing.assert_array_equal(ra.dense, rb.dense)
        _same_sparse(ra, rb)
    ea, eb = list(eval_rows(tsv, ReadCounters())), list(eval_rows(par, ReadCounters()))
    np.testing.assert_array_equal(np.concatenate([r.labels for r in ea]), np.concatenate([r.labels for r in eb]))


def test_parquet_resumes_exactly(criteo):
    out, _ = criteo
    _, par = _configs(out)
    full = list(train_batches(par, ReadCounters()))
    resumed = list(train_batches(par, ReadCounters(), start=full[4][1]))
    assert len(resumed) == len(full) - 5
    for (ra, pa_), (rb, pb) in zip(full[5:], resumed):
        assert pa_ == pb
        np.testing.assert_array_equal(ra.labels, rb.labels)
        _same_sparse(ra, rb)


def _write(path, columns: dict, row_group_size=4):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


def _spec(features, labels=("click",), dense=("d0",)):
    tree = {"data": {"train": ["x"], "format": "parquet", "labels": list(labels), "dense_columns": list(dense)},
            "num_dense": len(dense), "features": features}
    return ParquetSpec.from_config(from_dict(tree))


def test_multi_hot_and_sequences_truncate_to_the_most_recent(tmp_path):
    path = _write(tmp_path / "a.parquet", {
        "click": pa.array([1, 0, 1, 0, 1], pa.int8()), "conv": pa.array([0.0, 0, 1, 0, 1]),
        "d0": pa.array([0.5, None, 1, 2, 3], pa.float32()),
        "user": pa.array([7, None, 7, 9, 11], pa.int64()),
        "hist": pa.array([[1, 2, 3, 4], [], None, [5, None, 6], [8]], pa.list_(pa.int64())),
        "tags": pa.array([["a", "b"], ["c"], [], ["", "d"], None], pa.list_(pa.string()))})
    spec = _spec([{"name": "user", "group": 1}, {"name": "hist", "group": 2, "kind": "list", "pooling": "none",
                                                  "max_len": 2},
                  {"name": "tags", "group": 3, "kind": "list", "pooling": "mean"}], labels=("click", "conv"))
    (chunk,) = read_parquet(path, spec, chunk_rows=10)
    rows = chunk.rows
    assert rows.labels.shape == (5, 2) and rows.labels[2].tolist() == [1, 1]
    assert rows.dense[:, 0].tolist() == [0.5, 0, 1, 2, 3]
    user, hist, tags = rows.bags.bags()
    assert user.lengths.tolist() == [1, 0, 1, 1, 1] and user.values[0] == user.values[1]
    assert hist.lengths.tolist() == [2, 0, 0, 2, 1]  # [1,2,3,4] keeps its last two; the null element is dropped
    (ref,) = read_parquet(path, _spec([{"name": "hist", "group": 2, "kind": "list", "max_len": 10}]), chunk_rows=10)
    np.testing.assert_array_equal(hist.values[:2], ref.rows.bags.bag(0).values[2:4])
    assert tags.lengths.tolist() == [2, 1, 0, 1, 0]  # the empty string is absent, as an empty TSV field
    assert chunk.num_truncated == 1 and chunk.num_bad_rows == 0 and chunk.end_row == 5


def test_bad_rows_skip_or_stop_naming_file_row_group_and_row(tmp_path):
    path = _write(tmp_path / "b.parquet", {"click": pa.array([1, None, 0, 1, 2, 0], pa.int64()),
                                           "d0": pa.array([1.0] * 6), "c": pa.array(["x"] * 6)})
    spec = _spec([{"name": "c", "group": 0}])
    chunks = list(read_parquet(path, spec, chunk_rows=2))
    assert [len(c) for c in chunks] == [2, 2] and sum(c.num_bad_rows for c in chunks) == 2
    assert chunks[-1].end_row == 6
    with pytest.raises(ParquetFormatError, match=r"b.parquet: row group 0, row 1 \(file row 1\): label column "
                                                 r"'click' is null"):
        list(read_parquet(path, spec, chunk_rows=2, bad_lines="error"))
    with pytest.raises(ParquetFormatError, match=r"row group 1, row 0 \(file row 4\): label column 'click' is 2, not 0 or 1"):
        list(read_parquet(path, spec, chunk_rows=2, bad_lines="error", start_row=2))


@pytest.mark.parametrize("columns, features, message", [
    ({"c": pa.array(["x"])}, [{"name": "missing", "group": 0}], r"features.0 \(missing\).column: no column 'missing'"),
    ({"c": pa.array([[1]], pa.list_(pa.int64()))}, [{"name": "c", "group": 0}],
     r"c.parquet: features.0 \(c\), column 'c': a list column .* where a scalar is configured"),
    ({"c": pa.array([1])}, [{"name": "c", "group": 0, "kind": "list"}], "kind list needs a list column, not int64"),
    ({"c": pa.array([1.5])}, [{"name": "c", "group": 0}], r"a float ID column must hold whole numbers \(row 0 is "
                                                          r"1.5\)"),
    ({"c": pa.array([True])}, [{"name": "c", "group": 0}], "IDs must be integers or strings, not bool"),
])
def test_wrong_columns_are_named(tmp_path, columns, features, message):
    path = _write(tmp_path / "c.parquet", {"click": pa.array([1]), "d0": pa.array([1.0]), **columns})
    with pytest.raises(ParquetFormatError, match=message):
        list(read_parquet(path, _spec(features), chunk_rows=4))


def test_a_dense_column_of_text_is_refused_naming_it(tmp_path):
    path = _write(tmp_path / "d.parquet", {"click": pa.array([1]), "d0": pa.array(["1"]), "c": pa.array(["x"])})
    with pytest.raises(ParquetFormatError, match=r"d.parquet: data.dense_columns \(d0\): a dense column must be "
                                                 r"float, integer, decimal or boolean, not string"):
        read_parquet(path, _spec([{"name": "c", "group": 0}]), chunk_rows=4)  # from the schema, when opened


def test_config_tables_and_rejections():
    base = {"data": {"train": ["x"], "format": "parquet"}, "tables": [{"name": "item", "group": 4, "dim": 8}]}
    config = from_dict({**base, "features": [{"name": "target", "table": "item"},
                                             {"name": "hist", "table": "item", "kind": "list", "pooling": "none"}]})
    assert [(f.group, f.dim) for f in config.features] == [(4, 8), (4, 8)]
    with pytest.raises(ConfigError, match=r"features.0.table: unknown table 'nope'"):
        from_dict({**base, "features": [{"name": "x", "table": "nope"}]})
    with pytest.raises(ConfigError, match=r"features.0.pooling: none \(a sequence\) needs kind: list"):
        from_dict({**base, "features": [{"name": "x", "group": 1, "pooling": "none"}]})
    with pytest.raises(ConfigError, match=r"data.labels: a TSV file has one label"):
        from_dict({"data": {"train": ["x"], "labels": ["a", "b"]}})
    with pytest.raises(ConfigError, match=r"training.task_weights: 1 weights for 2 tasks"):
        from_dict({**base, "data": {"train": ["x"], "format": "parquet", "labels": ["a", "b"]},
                   "training": {"task_weights": [1.0]}, "features": [{"name": "x", "group": 1}]})
