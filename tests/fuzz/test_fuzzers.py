"""Every coverage-guided fuzz target (tests/fuzz/targets.py) runs for FUZZ_SECONDS (30 in CI) under atheris,
from its seed corpus: nothing but the decoder's own error type escapes, within libFuzzer's memory limit. The
long runs (10^6 executions or 10 minutes each, with their coverage) are benchmarks/fuzz.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.fuzz.run import CORPUS
from tests.fuzz.targets import RUNS, target

pytestmark = pytest.mark.faults

SECONDS = int(os.environ.get("FUZZ_SECONDS", "30"))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_fuzzer_finds_nothing(name, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tests.fuzz.run", name, f"-max_total_time={SECONDS}",
                          f"--work={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 300)
    tail = out.stderr[-4000:]
    assert out.returncode == 0 and "Uncaught Python exception" not in out.stderr, tail
    runs = int(re.search(r"Done (\d+) runs", out.stderr).group(1))
    assert runs >= 1000, tail  # it ran
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("oom-*")), tail


@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_seed_in_the_repository_is_a_well_formed_input(name):
    """The seeds decode without an error (they are the corpus the fuzzer mutates: valid inputs, so that it
    explores past the first checks); `python -m tests.fuzz.run --write-seeds` writes them again."""
    fuzzed = target(name)
    seeds = sorted((CORPUS / name).iterdir())
    assert [p.read_bytes() for p in seeds] == fuzzed.seeds()
    for seed in seeds:
        if name == "frames" and seed.read_bytes()[1:] == b"":
            continue  # the slot layout's seed is empty: its decoder refuses it
        fuzzed.run(seed.read_bytes())
