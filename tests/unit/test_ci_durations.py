"""benchmarks/ci_durations.py: two runs' --durations output compared on the tests both hold."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import ci_durations

BEFORE = """\
::: [0 s] python environment
============================== slowest durations ===============================
20.00s call     tests/integration/test_x.py::test_kept[a]
1.50s setup    tests/integration/test_x.py::test_kept[a]
10.00s call     tests/integration/test_x.py::test_faster
4.00s call     tests/integration/test_x.py::test_gone
======= 3 passed, 1 skipped in 40.25s (0:00:40) =======
::: [52 s] done
"""
AFTER = """\
============================== slowest durations ===============================
18.00s call     tests/integration/test_x.py::test_kept[a]
7.00s call     tests/integration/test_y.py::test_added
======= 1 failed, 4 passed in 33.00s =======
"""


def test_the_shared_tests_are_summed_and_a_faster_one_counts_as_the_floor(tmp_path: Path):
    (tmp_path / "tests" / "integration").mkdir(parents=True)
    (tmp_path / "tests" / "integration" / "test_x.py").write_text(
        "def test_kept(a):\n    pass\n\n\ndef test_faster():\n    pass\n")
    result = ci_durations.compare(BEFORE, AFTER, tmp_path)
    common = result["common"]
    assert common["tests"] == 2 and common["before_s"] == 31.5
    assert common["after_s"] == 18.0 + ci_durations.FLOOR_S  # test_faster was not printed: under 3 s
    assert common["ratio"] == pytest.approx(21.0 / 31.5, abs=1e-4)
    assert common["under_floor_in_after"] == ["tests/integration/test_x.py::test_faster"]
    assert result["gone"] == ["tests/integration/test_x.py::test_gone"]
    assert result["added"] == {"tests": 1, "seconds": 7.0,
                               "largest": [["tests/integration/test_y.py::test_added", 7.0]]}
    assert result["before"] == {"summary": "3 passed, 1 skipped", "pytest_s": 40.25, "ci_run_s": 52}
    assert result["after"] == {"summary": "1 failed, 4 passed", "pytest_s": 33.0, "ci_run_s": None}
