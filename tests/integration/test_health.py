"""Readiness over grpc.health.v1: a service that listens but whose dependencies do not answer yet is alive
(`liveness` SERVING) and not ready (the overall status NOT_SERVING); it turns ready once they answer.
Readiness probes (Kubernetes, compose healthchecks, `hybridrec health`) and peers waiting in
`rpc.wait_until_serving` read the overall status."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from hybridrec.core.runtime import rpc
from hybridrec.app.run.ports import free_port
from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration


def _serve(tmp_path: Path, config: Path, service: str) -> subprocess.Popen:
    return subprocess.Popen(HYBRIDREC + ["serve", service, "--config", str(config), "--replica", "0"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{service}.log").open("ab"))


def test_an_embedding_worker_is_alive_but_not_ready_until_its_ps_answers(tmp_path):
    ps, worker = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": 8}],
        "ps": {"capacity": 10_000, "num_stripes": 2, "shm_dir": str(tmp_path / "shm")},
        "cluster": {"ps": [ps], "embedding_workers": [worker], "bind_host": "127.0.0.1", "start_timeout_s": 600},
    }))
    procs = [_serve(tmp_path, config, "embedding_worker")]
    try:
        deadline = time.monotonic() + 120
        while not asyncio.run(rpc.is_serving(worker, service=rpc.LIVENESS)):
            assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "embedding_worker.log").read_text()
            time.sleep(0.1)
        for _ in range(5):  # listening, its PS absent: alive, not ready
            assert not asyncio.run(rpc.is_serving(worker)), "SERVING before its PS answers"
            time.sleep(0.1)
        procs.append(_serve(tmp_path, config, "embedding_ps"))
        asyncio.run(rpc.wait_until_serving([ps, worker], timeout_s=120))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def test_a_service_stopped_while_it_waits_for_its_peers_exits_at_once(tmp_path):
    """SIGTERM while a service still starts (here: an embedding worker waiting for a PS that never comes) stops
    it within seconds, exit 0, instead of when its start-up wait times out (a pod torn down would wait for its
    kill)."""
    worker = f"127.0.0.1:{free_port()}"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": 8}],
        "ps": {"capacity": 10_000, "num_stripes": 2, "shm_dir": str(tmp_path / "shm")},
        "cluster": {"ps": [f"127.0.0.1:{free_port()}"], "embedding_workers": [worker], "bind_host": "127.0.0.1",
                    "start_timeout_s": 600},
    }))
    proc = _serve(tmp_path, config, "embedding_worker")
    try:
        deadline = time.monotonic() + 120
        while not asyncio.run(rpc.is_serving(worker, service=rpc.LIVENESS)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "embedding_worker.log").read_text()
            time.sleep(0.1)
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        assert "stopped_while_starting" in (tmp_path / "embedding_worker.log").read_text()
    finally:
        proc.kill()
        proc.wait()
