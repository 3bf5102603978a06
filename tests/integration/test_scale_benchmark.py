"""benchmarks/scale.py's CI form: a PS checkpoint of a 400k-row table, taken while a thread trains the store,
adds no more private memory than the bound `hybridrec plan` counts (`checkpoint.dump_memory_bytes`), a delta
holds the changed rows and no more, and full + delta restore a sample bit for bit; for float32 rows with
Adagrad and for compact rows (fp16 weights, one accumulator a row). A bound, not a time."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize("layout", [[], ["--storage", "fp16", "--optimizer", "rowwise_adagrad"]],
                         ids=["fp32-adagrad", "fp16-rowwise"])
def test_the_quick_scale_benchmark_holds_its_memory_bound(tmp_path, layout):
    out = tmp_path / "scale.json"
    result = subprocess.run([sys.executable, "benchmarks/scale.py", "--quick", "--out", str(out), *layout], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["storage"] == (layout[1] if layout else "fp32")
    assert row["full"]["rows"] == 400_000 and row["full"]["bytes"] >= 400_000 * row["row_bytes"]
    assert 0 < row["full"]["extra_private_bytes"] <= row["bound_bytes"] + report["slack_bytes"]
    table = row["full"]["rows"] * row["row_bytes"]
    assert row["full"]["extra_private_bytes"] < table / 2  # a dump that copied the table took over 2x its bytes
    assert row["delta"]["chain"] == [1, 2] and row["delta"]["rows"] == row["delta"]["changed_rows"] > 0
    assert row["delta"]["bytes_per_changed_row_bytes"] <= 1.1
    assert row["restore"]["sample_bit_for_bit"] and row["restore"]["rows"] == row["restore"]["rows_before"]
