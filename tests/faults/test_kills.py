"""kill -9 of a PS, an embedding-worker or an NN-worker process mid-run: `hybridrec run` finishes normally.

Each disturbed run must end within 0.005 eval AUC of an undisturbed run of the
same config, having trained every sample, with the restart counted in the
summary. An embedding worker's buffer is on file, so its restart skips no
batch and loses no update: it re-attaches the batches it held (counted in the
summary), and pushes re-sent across the restart are applied once.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hybridrec.synth import synthesize
from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.faults

ROWS = 1_000_000  # the synthetic example of the README: smaller sets are too noisy for a 0.005 AUC bound


@pytest.fixture(scope="module")
def fault_config(tmp_path_factory) -> Path:
    """examples/criteo_synth.yaml on its 1M-row data, with checkpoints every 20 steps (for the NN-worker kill)."""
    root = tmp_path_factory.mktemp("faults")
    synthesize(root / "data", rows=ROWS, seed=0)
    tree = yaml.safe_load((REPO / "examples" / "criteo_synth.yaml").read_text())
    tree["data"] = {"train": [str(root / "data" / "train.tsv")], "eval": [str(root / "data" / "eval.tsv")],
                    "oracle": str(root / "data" / "oracle.json")}
    tree["checkpoint"] = {"interval_steps": 20}
    (root / "config.yaml").write_text(yaml.safe_dump(tree))
    return root / "config.yaml"


def _run(config: Path, run_dir: Path, kill: str | None = None) -> dict:
    summary = run_dir / "summary-out.json"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir), "--summary-json",
                                         str(summary)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    killed = None
    if kill:
        killed = _kill_mid_run(run_dir, kill)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(summary.read_text())
    result["killed_pid"] = killed
    return result


def _kill_mid_run(run_dir: Path, service: str) -> int:
    """SIGKILL replica 0 of `service` once NN rank 0 has trained ~30% of its steps."""
    config_path = str(run_dir / "config.yaml")
    deadline = time.monotonic() + 600
    steps_total = ROWS // 4096 // 2
    while time.monotonic() < deadline:
        log = run_dir / "logs" / "nn_worker-0.log"
        status = _status(run_dir)
        if status is not None and status >= steps_total * 0.3:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"training did not get going; see {log}")
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"serve {service} --config {config_path} --replica 0" in cmd:
            p.send_signal(signal.SIGKILL)
            return p.pid
    raise AssertionError(f"no {service} process found")


def _status(run_dir: Path) -> int | None:
    """Rank 0's step, from its Status RPC."""
    import grpc
    import yaml

    from hybridrec.proto import pb

    try:
        address = yaml.safe_load((run_dir / "config.yaml").read_text())["cluster"]["nn_workers"][0]
    except (OSError, TypeError, KeyError):
        return None
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary("/hybridrec.NNWorker/Status", request_serializer=pb.Empty.SerializeToString,
                              response_deserializer=pb.TrainingStatus.FromString)
        try:
            return call(pb.Empty(), timeout=1).step
        except grpc.RpcError:
            return None


@pytest.fixture(scope="module")
def undisturbed(fault_config, tmp_path_factory) -> dict:
    return _run(fault_config, tmp_path_factory.mktemp("undisturbed"))


@pytest.mark.parametrize("service", ["embedding_ps", "embedding_worker", "nn_worker"])
def test_kill_minus_9_mid_run(fault_config, undisturbed, tmp_path, service):
    result = _run(fault_config, tmp_path / "run", kill=service)
    restarted = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarted[(service, 0)] == 1
    if service == "nn_worker":  # the whole group went back to the newest checkpoint together
        assert restarted[("nn_worker", 1)] == 1 and restarted[("dataloader", 0)] == 1
        logs = (tmp_path / "run" / "logs" / "nn_worker-1.log").read_text()
        assert '"checkpoint_restored"' in logs
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])
    assert result["samples"] == undisturbed["samples"]
    if service == "embedding_worker":
        assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
        assert result["skipped_eval_batches"] == 0
        assert result["batches_recovered"] > 0  # it held batches when it died, and served them after
        assert result["updates_deduplicated"] is not None
