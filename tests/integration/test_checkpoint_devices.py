"""Job checkpoints are device-independent: a dense state saved on a GPU resumes on a CPU worker, and a
checkpoint of another model stops the NN workers at start naming the file (exit 2, no restart loop).

The GPU side is simulated the way torch records it: every storage of `dense.pt` is tagged `cuda:0`
(tests/unit/test_gpu_path.saved_as_cuda), which a plain `torch.load` on this CPU-only machine refuses.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import HYBRIDREC, REPO
from tests.unit.test_gpu_path import saved_as_cuda

pytestmark = pytest.mark.integration


def _run(config, run_dir, *sets: str) -> subprocess.CompletedProcess:
    args = ["run", str(config), "--run-dir", str(run_dir), "--summary-json", str(run_dir / "out.json")]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, timeout=300)


def _record(dense: Path) -> None:
    """The checkpoint's manifest, its record of `dense` (size, sha256) made anew after the file was rewritten."""
    from hybridrec.core.layouts import checkpoints as layout

    manifest = dense.parent / layout.MANIFEST
    tree = json.loads(manifest.read_text())
    tree["files"][dense.name] = layout.file_entry(dense)
    manifest.write_text(json.dumps(tree))


def test_a_gpu_checkpoint_resumes_on_cpu_workers_and_another_model_is_refused(tmp_path, small_config):
    checkpoints = tmp_path / "checkpoints"
    common = (f"checkpoint.dir={checkpoints}", "checkpoint.interval_steps=5")
    first = _run(small_config, tmp_path / "first", *common, "training.max_steps=10")
    assert first.returncode == 0, first.stderr[-3000:]
    dense = sorted(checkpoints.glob("step-*/dense.pt"))
    assert dense, "no checkpoint written"
    for path in dense:  # rewrite each as a GPU worker would have saved it
        state = torch.load(path, weights_only=True)
        with saved_as_cuda():
            torch.save(state, path)
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)
        _record(path)  # as the GPU worker's checkpoint would have recorded its file

    resumed = _run(small_config, tmp_path / "resumed", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (tmp_path / "resumed" / "logs" / "nn_worker-0.log").read_text()
    restored = [json.loads(line) for line in log.splitlines() if '"checkpoint_restored"' in line]
    assert len(restored) == 1 and restored[0]["step"] == 10, restored
    summary = json.loads((tmp_path / "resumed" / "out.json").read_text())
    assert summary["samples"] == 60_000 and summary["steps"] > 10, summary  # every row, once

    other = _run(small_config, tmp_path / "other", *common, "model.kwargs.hidden=[32]")
    assert other.returncode != 0
    worker_log = (tmp_path / "other" / "logs" / "nn_worker-0.log").read_text()
    assert "does not fit this job's dense model" in worker_log and "dense.pt" in worker_log, worker_log[-2000:]
    services = json.loads((tmp_path / "other" / "services.json").read_text())
    restarts = {(s["name"], s["replica"]): s["restarts"] for s in services}
    assert restarts[("nn_worker", 0)] == 0, restarts  # a usage error: not restarted


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host nccl is a valid backend")
def test_nccl_without_cuda_stops_the_nn_worker_before_it_listens(small_config):
    result = subprocess.run(HYBRIDREC + ["serve", "nn_worker", "--config", str(small_config), "--replica", "0",
                                         "--set", "training.backend=nccl"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "training.backend is nccl but CUDA is not available" in result.stderr
    assert '"listening"' not in result.stdout + result.stderr
