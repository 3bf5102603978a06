"""A local run listens on loopback only: gRPC, metrics, the torch.distributed store and Gloo."""
from __future__ import annotations

import ipaddress

import pytest

pytestmark = pytest.mark.integration


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_local_run_listens_on_loopback_only(watched_run):
    """Every service's listening sockets, sampled while the job trained (NN workers had joined Gloo by then)."""
    assert watched_run.returncode == 0, watched_run.stderr[-3000:]
    seen = watched_run.listening
    assert {"nn_worker-0", "nn_worker-1", "embedding_ps-0", "embedding_worker-0", "dataloader-0"} <= set(seen), seen
    # rank 0 listens on gRPC, metrics, the torch.distributed store and Gloo: all four were sampled
    assert len(seen["nn_worker-0"]) >= 4, seen["nn_worker-0"]
    exposed = {name: sorted(a for a in addrs if not _is_loopback(a[0])) for name, addrs in seen.items()}
    assert not any(exposed.values()), f"listening outside loopback: {exposed}"
