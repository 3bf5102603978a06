"""What a service process imports before it listens: start-up costs CPU seconds per heavy package.

torch costs about 2 CPU-seconds to import and scikit-learn (with scipy) about as much; on a small machine the
six processes of `hybridrec run` share a few cores, so a package imported where it is not needed delays every
service's start (docs/architecture.md#start-up). Each check runs in a fresh interpreter.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "sklearn", "scipy.stats")


def imported_after(*modules: str) -> set[str]:
    """Which of HEAVY a fresh interpreter holds after importing the CLI and `modules`."""
    code = ("import json, sys\nimport hybridrec.app.cli\n" + "".join(f"import {m}\n" for m in modules)
            + f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("service", ["dataloader", "embedding_ps", "embedding_worker"])
def test_services_without_a_dense_model_start_without_torch_or_sklearn(service):
    assert imported_after(f"services.{service}.server") == set()


def test_the_launcher_starts_without_torch_or_sklearn():
    assert imported_after("hybridrec.app.run.launcher") == set()


def test_the_nn_worker_imports_torch_but_not_sklearn_before_it_evaluates():
    assert imported_after("services.nn_worker.server") == {"torch"}
