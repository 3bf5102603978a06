"""A job started on an empty kernel cache compiles every kernel before its services serve: from SERVING on, a
compile is logged as `kernel_compiled_while_serving` (hybridrec/core/runtime/kernel_cache.py), and none is, through
training,
checkpoints and evaluation. The inference service's own check is tests/integration/test_inference_warm_up.py."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_a_job_on_an_empty_kernel_cache_compiles_nothing_while_it_trains(tmp_path, small_config):
    cache = tmp_path / "kernels"
    run = tmp_path / "run"
    result = subprocess.run(HYBRIDREC + ["run", str(small_config), "--run-dir", str(run),
                                         "--set", "checkpoint.interval_steps=10"],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NUMBA_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    builds = [p for p in cache.iterdir() if p.is_dir()]
    assert len(builds) == 1 and any(builds[0].glob("*.nbc"))  # compiled into the empty cache given
    logs = sorted((run / "logs").glob("*-[0-9].log"))
    services = {p.stem.rsplit("-", 1)[0] for p in logs}
    assert services == {"dataloader", "embedding_ps", "embedding_worker", "nn_worker"}, logs
    for path in logs:
        events = _events(path)
        assert any(e.get("event") == "serving" for e in events), path
        late = [e for e in events if e.get("event") == "kernel_compiled_while_serving"]
        assert not late, (path.name, late)
    assert any((run / "checkpoints").glob("step-*/manifest.json"))
