"""`hybridrec run` of the README example on prepared data: the same batches as the TSV, so the same model.

Both runs use sync mode with staleness 0 on one NN worker and one PS shard, so
that training is deterministic (every lookup sees every earlier update) and the
two eval AUCs can be compared to 1e-6: equal batches, equal model.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration

DETERMINISTIC = ["training.mode=sync", "training.staleness=0", "training.batch_size=2048", "ps.capacity=100000",
                 "cluster.nn_workers=[127.0.0.1:0]", "cluster.ps=[127.0.0.1:0]", "model.kwargs.hidden=[64,32]"]


def _run(tmp_path, name: str, train: str, eval_: str, oracle: str) -> dict:
    summary = tmp_path / f"{name}.json"
    args = ["run", "examples/criteo_synth.yaml", "--run-dir", str(tmp_path / name), "--summary-json", str(summary)]
    for item in DETERMINISTIC + [f"data.train=[{train}]", f"data.eval=[{eval_}]", f"data.oracle={oracle}"]:
        args += ["--set", item]
    result = subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(summary.read_text())


def test_prepared_data_trains_the_same_model_as_the_tsv(tmp_path, small_data):
    for name in ("train", "eval"):
        result = subprocess.run(HYBRIDREC + ["data", "prepare", str(small_data / f"{name}.tsv"), "--out",
                                             str(tmp_path / f"{name}.prep")], cwd=REPO, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
    oracle = str(small_data / "oracle.json")
    tsv = _run(tmp_path, "tsv", small_data / "train.tsv", small_data / "eval.tsv", oracle)
    prepared = _run(tmp_path, "prepared", tmp_path / "train.prep", tmp_path / "eval.prep", oracle)
    assert prepared["samples"] == tsv["samples"] == 60_000
    assert prepared["data"]["train"]["rows"] == tsv["data"]["train"]["rows"] == 60_000
    assert prepared["auc"] > 0.6
    assert prepared["auc"] == pytest.approx(tsv["auc"], abs=1e-6)
    assert prepared["logloss"] == pytest.approx(tsv["logloss"], abs=1e-6)
