"""Shared fixtures: a small synthetic dataset and a config pointing at it."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import yaml

from hybridrec.app.data.synth import synthesize

REPO = Path(__file__).resolve().parents[1]
HYBRIDREC = [sys.executable, "-m", "hybridrec"]

# Tests press Ctrl-C on the processes they start (SIGINT). A shell that runs the suite in the background
# (`bash .ci/run &`) starts it with SIGINT ignored, and an ignored signal stays ignored in every child
# through exec: Python would then never raise KeyboardInterrupt there. A handler is reset to the default
# by exec instead, so this one line gives every child the usual Ctrl-C.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    synthesize(out, rows=60_000, eval_rows=20_000, seed=3)
    return out


def write_config(path: Path, data: Path, **sections) -> Path:
    tree = {
        "data": {"train": [str(data / "train.tsv")], "eval": [str(data / "eval.tsv")],
                 "oracle": str(data / "oracle.json")},
        "model": {"path": "hybridrec.models:DNN", "kwargs": {"hidden": [64, 32]}},
        "training": {"batch_size": 2048, "staleness": 2, "prefetch": 2},
        "ps": {"capacity": 100_000, "num_stripes": 4},
    }
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def small_config(tmp_path, small_data) -> Path:
    return write_config(tmp_path / "config.yaml", small_data)
