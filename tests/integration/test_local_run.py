"""`hybridrec run` end to end: real processes, real gRPC, real torch.distributed, real shm files."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hybridrec.app.plan.job_plan import JobPlan
from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration


def _run(args, timeout=300, **kw):
    return subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)


def _port_free(address: str) -> bool:
    """Nothing listens on the port (connections in TIME_WAIT do not hold it: servers use SO_REUSEADDR)."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


def _assert_clean(summary_or_run_dir) -> None:
    """No service or fork-server process left, no port bound, no shm files."""
    config_path = Path(summary_or_run_dir) / "config.yaml"
    import yaml
    config = yaml.safe_load(config_path.read_text())
    cluster = config["cluster"]
    addresses = cluster["ps"] + cluster["embedding_workers"] + cluster["nn_workers"] + cluster["dataloader"]
    deadline = time.monotonic() + 5
    while True:
        leftovers = [p for p in psutil.process_iter(["cmdline"])  # services name the config, parents its logs
                     if str(config_path.parent) in " ".join(p.info["cmdline"] or [])]
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leftovers, f"service processes left behind: {leftovers}"
    assert all(_port_free(a) for a in addresses), "a service port is still bound"
    assert not Path(config["ps"]["shm_dir"]).exists(), "PS shm files were not removed"


def _log_events(log: Path, event: str) -> list[dict]:
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [r for r in records if r.get("event") == event]


def _assert_plan_is_what_started(run_dir: Path, summary: dict) -> None:
    """run_dir/plan.json, written before the services started, against what they said once they had: every
    replica listened on the plan's port (and no other replica ran), every PS shard created the plan's stores,
    and the NN workers formed a group of the plan's size."""
    plan = JobPlan.read(run_dir)
    assert {(p.service, p.replica): p.address for p in plan.services} == {
        (s["name"], s["replica"]): s["grpc"] for s in summary["services"]}
    for p in plan.services:
        listened = [r["port"] for r in _log_events(run_dir / "logs" / f"{p.service}-{p.replica}.log", "listening")]
        assert listened and set(listened) == {p.port}, (p, listened)
    assert [s.dim for s in plan.stores] == [16]
    for shard in plan.of_service("embedding_ps"):
        created = {r["dim"]: r["capacity"]
                   for r in _log_events(run_dir / "logs" / f"embedding_ps-{shard.replica}.log", "created embedding store")
                   if "warmup" not in r["directory"]}  # its warm-up's scratch store is not the shard's
        assert created == {s.dim: s.rows_per_shard for s in plan.stores}, created
    ready = _log_events(run_dir / "logs" / "nn_worker-0.log", "process_group_ready")
    assert ready and ready[0]["world_size"] == len(plan.of_service("nn_worker")) == summary["nn_workers"]
    assert plan.ps_memory_bytes > plan.ps_files_bytes > 0
    shown = _run(["plan", "--run-dir", str(run_dir)])  # `hybridrec plan` shows the same table
    assert shown.returncode == 0 and shown.stdout.splitlines() == plan.lines(), shown.stderr


def test_run_trains_and_cleans_up(tmp_path, small_config):
    summary_path = tmp_path / "summary.json"
    result = _run(["run", str(small_config), "--run-dir", str(tmp_path / "run"), "--summary-json",
                   str(summary_path), "--set", "training.epochs=2", "--set", "checkpoint.interval_steps=20"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    # A checkpoint counts the rows the ranks trained, not rank 0's times two: an epoch is 29 batches of 2048
    # and one of 608 (seq 29, 59: rank 1's), so at step 20 (batches 0-39) rank 1 is 1440 rows behind rank 0.
    manifests = {int(m.parent.name.removeprefix("step-")): json.loads(m.read_text())
                 for m in (tmp_path / "run" / "checkpoints").glob("step-*/manifest.json")}
    assert {step: m["samples"] for step, m in manifests.items()} == {20: 60_000 + 10 * 2048, 30: 120_000}
    for key in ("mode", "steps", "samples", "wall_s", "samples_per_sec", "auc", "logloss", "oracle_auc",
                "staleness", "services"):
        assert key in summary, key
    assert summary["mode"] == "hybrid"
    assert summary["samples"] == 120_000 and summary["eval_samples"] == 20_000
    assert summary["auc"] > 0.65, summary
    assert 0.7 < summary["oracle_auc"] < 0.95
    assert summary["staleness"]["max"] <= 2
    # The compute threads' CPU in training steps: positive, and no more than their wall time in steps
    # (one thread per NN worker, torch_threads 1) plus scheduling slack.
    steps_wall = summary["compute_per_step_s"] * summary["steps"] * summary["nn_workers"]
    assert 0 < summary["compute_cpu_s"] <= steps_wall * 1.1 + 0.5, summary
    names = sorted((s["name"], s["replica"]) for s in summary["services"])
    assert names == [("dataloader", 0), ("embedding_ps", 0), ("embedding_ps", 1), ("embedding_worker", 0),
                     ("nn_worker", 0), ("nn_worker", 1)]
    assert all(s["pid"] and s["grpc"].startswith("127.0.0.1:") for s in summary["services"])
    _assert_plan_is_what_started(tmp_path / "run", summary)
    _assert_clean(tmp_path / "run")


def test_failed_service_is_named_and_everything_stops(tmp_path, small_data):
    config = write_config(tmp_path / "c.yaml", small_data,
                          model={"path": "tests.integration.failing_model:FailAtStep", "kwargs": {"step": 3}})
    started = time.monotonic()
    result = _run(["run", str(config), "--run-dir", str(tmp_path / "run")], timeout=120)
    assert result.returncode == 1
    assert "service nn_worker-" in result.stderr and "exited with code" in result.stderr
    assert "planted failure at step 3" in result.stderr  # the service's last log lines are shown
    assert time.monotonic() - started < 90
    # A report of what was recorded, marked incomplete, naming the failed service.
    page = (tmp_path / "run" / "report.html").read_text()
    assert 'data-status="incomplete"' in page and "service nn_worker-" in page
    assert "planted failure at step 3" in page
    assert f"partial report (incomplete run): {tmp_path / 'run' / 'report.html'}" in result.stderr
    _assert_clean(tmp_path / "run")


def test_ctrl_c_stops_every_service(tmp_path, small_config):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(small_config), "--run-dir", str(run_dir),
                                         "--set", "training.epochs=20"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any('"at_work"' in p.read_text() for p in (run_dir / "logs").glob("nn_worker-*.log")):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    _assert_clean(run_dir)
    assert "interrupted (Ctrl-C)" in (run_dir / "report.html").read_text()  # a report of what was recorded


@pytest.mark.parametrize("args, message", [
    (["--set", "training.batch_size=-1"], "training.batch_size"),
    (["--set", "data.train=[/nonexistent/train.tsv]"], "/nonexistent/train.tsv"),
    (["--set", "model.path=nowhere.module:Model"], "nowhere.module"),
    (["--set", "cluster.nn_workers=[localhost]"], "cluster.nn_workers"),
])
def test_bad_input_exits_2_with_a_clear_message(small_config, args, message):
    result = _run(["run", str(small_config), *args], timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_killed_launcher_leaves_no_service_and_no_shared_memory(tmp_path, small_config):
    """kill -9 of `hybridrec run` itself mid-training: its services die with it (PR_SET_PDEATHSIG), and its
    fork servers, which outlive it for a moment, remove the run's shared memory (nobody else is left to)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(small_config), "--run-dir", str(run_dir),
                                         "--set", "training.epochs=20"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any('"at_work"' in p.read_text() for p in (run_dir / "logs").glob("nn_worker-*.log")):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    import yaml
    shm = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["ps"]["shm_dir"])
    assert shm.is_dir()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while shm.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    _assert_clean(run_dir)
