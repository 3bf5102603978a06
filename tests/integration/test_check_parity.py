"""What `hybridrec check` passes, `hybridrec run` trains: every refusal `run` makes of a config and its files
before training, `check` makes first, with the same message naming the file (and row) and the config key — and
`run` makes it before any service starts (no plan.json, no service log), the model's check aside (it runs
beside the services' start-up and stops them).

Each case is a config and files as a user might bring them; both commands run as the user runs them."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration


def _lines(data: Path, n: int = 200) -> list[bytes]:
    return (data / "train.tsv").read_bytes().splitlines(keepends=True)[:n]


def _tsv(tmp_path: Path, data: Path, *, line: int, field: int, value: bytes, name: str = "bad.tsv") -> Path:
    lines = _lines(data)
    fields = lines[line].rstrip(b"\n").split(b"\t")
    fields[field] = value
    lines[line] = b"\t".join(fields) + b"\n"
    (tmp_path / name).write_bytes(b"".join(lines))
    return tmp_path / name


def _parquet(tmp_path: Path, **columns) -> Path:
    n = 100
    table = {"click": pa.array([i % 2 for i in range(n)]), "d0": pa.array(np.linspace(0, 1, n)),
             "item": pa.array([f"i{i % 7}" for i in range(n)])}
    table.update({k: v(n) for k, v in columns.items()})
    pq.write_table(pa.table(table), tmp_path / "data.parquet")
    return tmp_path / "data.parquet"


def _parquet_config(tmp_path: Path, data: Path, path: Path, **data_keys) -> dict:
    tree = yaml.safe_load(write_config(tmp_path / "base.yaml", data).read_text())
    tree["data"] = {"train": [str(path)], "eval": [str(path)], "format": "parquet", "labels": ["click"],
                    "dense_columns": ["d0"], **data_keys}
    tree["num_dense"] = 1
    tree["features"] = [{"name": "item", "group": 1, "dim": 8}]
    return tree


def _tsv_config(tmp_path: Path, small: Path, path: Path | None = None, **sections) -> dict:
    tree = yaml.safe_load(write_config(tmp_path / "base.yaml", small).read_text())
    if path is not None:
        tree["data"]["train"] = [str(path)]
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return tree


Case = Callable[[Path, Path], tuple[dict, str]]
CASES: dict[str, Case] = {
    "a data file that is not there": lambda t, d: (_tsv_config(t, d, t / "nope.tsv"),
                                                   f"data.train: data file not found: {t / 'nope.tsv'}"),
    "a key the config does not have": lambda t, d: (_tsv_config(t, d, training={"batchsize": 5}),
                                                    "training.batchsize"),
    "a bad TSV line under bad_lines: error": lambda t, d: (
        _tsv_config(t, d, _tsv(t, d, line=40, field=2, value=b"x7"), data={"bad_lines": "error"}),
        f"{t / 'bad.tsv'}:41: column I2 is not an integer: b'x7'"),
    "a 309-digit TSV integer under non_finite: error": lambda t, d: (
        _tsv_config(t, d, _tsv(t, d, line=12, field=4, value=b"7" * 309)),
        f"{t / 'bad.tsv'}:13: column I4 is not finite: an integer of 309 digits"),
    "a dense transform TSV does not have": lambda t, d: (
        _tsv_config(t, d, data={"dense_transform": "none"}), "data.dense_transform: 'none'"),
    "a Parquet column that is not there": lambda t, d: (
        _parquet_config(t, d, _parquet(t), dense_columns=["d9"]),
        "data.dense_columns (d9): no column 'd9'"),
    "a Parquet dense column of text": lambda t, d: (
        _parquet_config(t, d, _parquet(t, d0=lambda n: pa.array([str(i) for i in range(n)]))),
        "data.dense_columns (d0): a dense column must be float, integer, decimal or boolean, not string"),
    "a list column where a scalar is configured": lambda t, d: (
        _parquet_config(t, d, _parquet(t, item=lambda n: pa.array([[i] for i in range(n)]))),
        "features.0 (item), column 'item': a list column"),
    "a NaN in the first rows under non_finite: error": lambda t, d: (
        _parquet_config(t, d, _parquet(t, d0=lambda n: pa.array([0.5] * 9 + [np.nan] * (n - 9)))),
        "row group 0, row 9 (file row 9): data.dense_columns (d0) is nan, not a finite number"),
    "a float ID that is not whole": lambda t, d: (
        _parquet_config(t, d, _parquet(t, item=lambda n: pa.array([0.5 * i for i in range(n)]))),
        "features.0 (item), column 'item': a float ID column must hold whole numbers (row 1 is 0.5)"),
    "a label that is not 0 or 1 under bad_lines: error": lambda t, d: (
        _parquet_config(t, d, _parquet(t, click=lambda n: pa.array([1, 0, 3] + [0] * (n - 3))), bad_lines="error"),
        "row 2 (file row 2): label column 'click' is 3, not 0 or 1"),
    "more data loaders than Parquet row groups": lambda t, d: (
        {**_parquet_config(t, d, _parquet(t)), "cluster": {"dataloader": ["127.0.0.1:0"] * 2}},
        "cluster.dataloader"),
    "PS shards that do not fit this host": lambda t, d: (
        _tsv_config(t, d, ps={"capacity": 2_000_000_000}), "ps.capacity"),
    "a model that does not build": lambda t, d: (
        _tsv_config(t, d, model={"path": "hybridrec.models:NoSuchModel"}), "NoSuchModel"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_refusal_of_run_is_made_by_check_first(case, tmp_path, small_data):
    tree, message = CASES[case](tmp_path, small_data)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tree))
    check = subprocess.run(HYBRIDREC + ["check", str(config)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 2 and message in check.stderr, check.stdout + check.stderr
    run_dir = tmp_path / "run"
    run = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-3000:]
    if case != "a model that does not build":  # refused before any service started
        assert not (run_dir / "plan.json").exists()
        assert not list(run_dir.glob("logs/*-0.log")), list(run_dir.glob("logs/*"))


def _summary(config: Path, run_dir: Path) -> dict:
    out = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir), "--summary-json",
                                      str(run_dir.parent / f"{run_dir.name}.json")], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return yaml.safe_load((run_dir.parent / f"{run_dir.name}.json").read_text())


def test_what_check_passes_of_users_data_run_trains_as_the_tsv(tmp_path, small_data):
    """The pandas-written Parquet of the small data (integer and float dense columns with nulls, string IDs,
    C1 as uint64 hashes over all 64 bits) passes check, and run trains it with `dense_transform: log1p` to the
    TSV's eval AUC within 0.002 (sync, one NN worker: the same batches in the same order; C1's IDs differ)."""
    import pandas as pd

    names = ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]
    for name in ("train", "eval"):
        frame = pd.read_csv(small_data / f"{name}.tsv", sep="\t", names=names)
        frame["C1"] = pd.util.hash_pandas_object(frame["C1"].fillna(""), index=False).to_numpy(np.uint64)
        assert frame["C1"].max() >= 2 ** 63
        frame.to_parquet(tmp_path / f"{name}.parquet")
    same = {"training": {"mode": "sync"}, "cluster": {"nn_workers": ["127.0.0.1:0"]}}
    tsv = tmp_path / "tsv.yaml"
    tsv.write_text(yaml.safe_dump(_tsv_config(tmp_path, small_data, **same)))
    tree = _tsv_config(tmp_path, small_data, **same)
    tree["data"].update({"train": [str(tmp_path / "train.parquet")], "eval": [str(tmp_path / "eval.parquet")],
                         "format": "parquet", "dense_transform": "log1p"})
    config = tmp_path / "parquet.yaml"
    config.write_text(yaml.safe_dump(tree))
    check = subprocess.run(HYBRIDREC + ["check", str(config)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "data and model ok" in check.stdout, check.stderr
    parquet, reference = _summary(config, tmp_path / "parquet"), _summary(tsv, tmp_path / "tsv")
    assert parquet["samples"] == reference["samples"] == 60_000 and parquet["eval_samples"] == 20_000
    assert reference["auc"] > 0.7 and abs(parquet["auc"] - reference["auc"]) <= 0.002, (parquet["auc"],
                                                                                         reference["auc"])
