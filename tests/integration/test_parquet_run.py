"""`hybridrec run` on the multi-task Parquet example: every service for real, two tasks, a sequence, multi-hot."""
from __future__ import annotations

import json
import subprocess

import pytest

from hybridrec.app.synth_parquet import synthesize_multitask
from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("example", ["multitask_parquet", "din_parquet"])
def test_multitask_parquet_example_trains_both_tasks(tmp_path, example):
    data = tmp_path / "data"
    synthesize_multitask(data, rows=60_000, eval_rows=20_000, seed=2)
    summary_path = tmp_path / "summary.json"
    overrides = [f"data.train=[{data / 'train.parquet'}]", f"data.eval=[{data / 'eval.parquet'}]",
                 f"data.oracle={data / 'oracle.json'}", "training.batch_size=2048", "ps.capacity=100000",
                 "cluster.nn_workers=[127.0.0.1:0]", "cluster.ps=[127.0.0.1:0]"]
    args = ["run", f"examples/{example}.yaml", "--run-dir", str(tmp_path / "run"),
            "--summary-json", str(summary_path)]
    for item in overrides:
        args += ["--set", item]
    result = subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    tasks = {t["name"]: t for t in summary["tasks"]}
    assert set(tasks) == {"click", "conversion"}
    for task in tasks.values():  # learned something, and the oracle of each task came through
        assert task["auc"] > 0.6 and task["oracle_auc"] > task["auc"] - 0.01, task
    assert summary["auc"] == tasks["click"]["auc"]
    assert summary["data"]["train"]["rows"] == 60_000 and summary["data"]["train"]["truncated_rows"] > 0
