"""The embedding lifecycle through `hybridrec run`: admission after 2 occurrences and a step TTL on a real
cluster, reported in the run summary (docs/architecture.md#embedding-lifecycle)."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration


def test_run_admits_after_k_expires_by_ttl_and_reports_per_table(tmp_path, small_config):
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(HYBRIDREC + ["run", str(small_config), "--run-dir", str(tmp_path / "run"),
                                         "--summary-json", str(summary_path),
                                         "--set", "ps.lifecycle.admit_after=2", "--set", "ps.lifecycle.ttl_steps=3",
                                         "--set", "ps.lifecycle.sweep_interval_s=0.2"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    tables = summary["lifecycle"]
    assert sorted(int(g) for g in tables) == list(range(26))  # every Criteo column is a table of its own
    total = {f: sum(t[f] for t in tables.values()) for f in ("admitted", "rejected", "expired", "dropped_gradients")}
    assert total["rejected"] > 0 and total["expired"] > 0 and 0 < total["dropped_gradients"] <= total["rejected"]
    # Nothing is evicted at this capacity: what the PS holds is what it admitted less what expired
    assert summary["ps_rows"] == total["admitted"] - total["expired"] > 0, (summary["ps_rows"], total)
    assert summary["auc"] > 0.6, summary["auc"]
