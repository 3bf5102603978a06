"""A local run listens on loopback only: gRPC, metrics, the torch.distributed store and Gloo."""
from __future__ import annotations

import ipaddress
import json
import subprocess
import time

import psutil
import pytest

from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_local_run_listens_on_loopback_only(tmp_path, small_config):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(small_config), "--run-dir", str(run_dir),
                                         "--set", "training.max_steps=10"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[str, set[tuple[str, int]]] = {}
    try:
        deadline = time.monotonic() + 240
        # Sample every service's listening sockets while the job trains (NN workers have joined Gloo by then).
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                services = json.loads((run_dir / "services.json").read_text())
            except (OSError, ValueError):
                time.sleep(0.5)
                continue
            for svc in services:
                try:
                    conns = psutil.Process(svc["pid"]).net_connections(kind="inet")
                except psutil.Error:
                    continue
                for c in conns:
                    if c.status == psutil.CONN_LISTEN:
                        seen.setdefault(f"{svc['name']}-{svc['replica']}", set()).add((c.laddr.ip, c.laddr.port))
            time.sleep(0.5)
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {"nn_worker-0", "nn_worker-1", "embedding_ps-0", "embedding_worker-0", "dataloader-0"} <= set(seen), seen
    # rank 0 listens on gRPC, metrics, the torch.distributed store and Gloo: all four were sampled
    assert len(seen["nn_worker-0"]) >= 4, seen["nn_worker-0"]
    exposed = {name: sorted(a for a in addrs if not _is_loopback(a[0])) for name, addrs in seen.items()}
    assert not any(exposed.values()), f"listening outside loopback: {exposed}"
