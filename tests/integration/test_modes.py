"""Every training mode runs through the same services and learns."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode, extra", [
    ("sync", []), ("async", ["--set", "training.sync_interval=4"]),
    ("shadow", ["--set", "training.shadow_algorithm=ma"]), ("shadow", ["--set", "training.shadow_algorithm=easgd"]),
    ("shadow", ["--set", "training.shadow_algorithm=bmuf"]),
    ("hybrid", ["--set", "training.precision=bf16"]),  # bf16 autocast through DDP and the embedding gradients
], ids=["sync", "async", "shadow-ma", "shadow-easgd", "shadow-bmuf", "hybrid-bf16"])
def test_mode_trains(tmp_path, small_config, mode, extra):
    summary_path = tmp_path / "s.json"
    result = subprocess.run(HYBRIDREC + ["run", str(small_config), "--run-dir", str(tmp_path / "run"),
                                         "--summary-json", str(summary_path), "--set", f"training.mode={mode}",
                                         *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["mode"] == mode
    assert summary["auc"] > 0.6, summary
    if mode == "sync":
        assert summary["staleness"]["max"] == 0
    logs = (tmp_path / "run" / "logs" / "nn_worker-1.log").read_text()
    assert "Traceback" not in logs
