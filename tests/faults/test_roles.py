"""Every RPC has one role — data plane, PS peer, control (hybridrec/core/runtime/rpc.py `ROLES`) — enforced by the
caller's
mutual-TLS identity: a certificate of the wrong role is refused each restricted method (PERMISSION_DENIED, logged
and counted), and a PS's backup takes rows only from its shard's primary (`cluster.ps_identities`). On 3b8ae06
any data-plane certificate could call Replicate (overwriting the backup a primary restores from) and PullShard
(exporting the whole shard). Two real `hybridrec serve embedding_ps` processes with `ps.replicas: 2`, each with
the certificate of its own identity."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from hybridrec.core.runtime import rpc
from hybridrec.app.run.ports import free_port
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import TLSConfig
from hybridrec.core.wire.frames import ShardPull, ShardRows
from hybridrec.core.wire.proto import pb
from tests.conftest import HYBRIDREC, REPO
from tests.faults.test_tls import _issue, _write

pytestmark = pytest.mark.faults

NAMES = ("ps-0", "ps-1", "control", "data")


@pytest.fixture
def identities(tmp_path):
    ca_key, ca_cert = _issue("hybridrec test CA", None, None, ca=True)
    _write(tmp_path, "ca", ca_key, ca_cert)
    for name in NAMES:
        key, cert = _issue(name, ca_key, ca_cert.subject, ca=False)
        _write(tmp_path, name, key, cert)
    return tmp_path


def _tls(pki: Path, name: str) -> dict:
    return {"ca": str(pki / "ca.pem"), "cert": str(pki / f"{name}.pem"), "key": str(pki / f"{name}.key")}


@contextlib.contextmanager
def _two_ps(tmp_path: Path, pki: Path):
    """PS 0 and PS 1 (each the other's backup), `control` the only control identity."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    procs = []
    try:
        for replica in range(2):
            config = tmp_path / f"ps{replica}.yaml"
            config.write_text(yaml.safe_dump({
                "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": 8}],
                "ps": {"capacity": 1000, "num_stripes": 2, "shm_dir": str(tmp_path / f"shm{replica}"), "replicas": 2},
                "checkpoint": {"dir": str(tmp_path / "root")},
                "cluster": {"ps": addresses, "bind_host": "127.0.0.1", "tls": _tls(pki, f"ps-{replica}"),
                            "control_identities": ["control"], "ps_identities": ["ps-0", "ps-1"]}}))
            procs.append(subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--config", str(config), "--replica",
                                                       str(replica)], cwd=REPO, stdout=subprocess.DEVNULL,
                                          stderr=(tmp_path / f"ps{replica}.log").open("wb")))
        yield addresses, procs
    finally:
        rpc.use_tls(None)
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def _requests() -> dict[str, tuple[str, bytes | object]]:
    """A request of each restricted PS method, as its rightful caller would send it to PS 1."""
    rows = ShardRows(0, 1, 1, {8: (np.arange(1, 4, dtype=np.uint64), np.ones((3, 16), np.float32))},
                     update_id=7, job="")
    return {"Checkpoint": ("control", pb.CheckpointRequest(name="by-them", step=1)),
            "LoadCheckpoint": ("control", pb.CheckpointRequest(name="nothing-here", step=1)),
            "Publish": ("control", pb.PublishRequest()),
            "Replicate": ("peer", rows.encode()),
            "PullShard": ("peer", ShardPull(shard=1, copy="primary", page=0).encode())}


async def _status(address: str, who: str, pki: Path, method: str, request) -> grpc.StatusCode:
    rpc.use_tls(TLSConfig(**_tls(pki, who)))
    async with rpc.channel(address) as channel:
        call = (rpc.control_method(channel, "EmbeddingPS", method) if isinstance(request, (pb.CheckpointRequest,
                                                                                           pb.PublishRequest))
                else rpc.raw_method(channel, "EmbeddingPS", method))
        try:
            await call(request, timeout=60)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def test_a_certificate_of_the_wrong_role_is_refused_each_restricted_method(tmp_path, identities):
    with _two_ps(tmp_path, identities) as (addresses, procs):
        async def scenario() -> dict[tuple[str, str], grpc.StatusCode]:
            rpc.use_tls(TLSConfig(**_tls(identities, "control")))
            await rpc.wait_until_serving(addresses, timeout_s=180)
            results = {}
            for method, (role, request) in _requests().items():
                callers = ("data", "ps-0", "control") if role == "control" else ("data", "control", "ps-1", "ps-0")
                for who in callers:
                    results[method, who] = await _status(addresses[1], who, identities, method, request)
            return results

        results = asyncio.run(scenario())
        log = (tmp_path / "ps1.log").read_text()
        assert all(proc.poll() is None for proc in procs)  # both serving still
    denied = grpc.StatusCode.PERMISSION_DENIED
    for method in ("Checkpoint", "LoadCheckpoint", "Publish"):
        assert results[method, "data"] == results[method, "ps-0"] == denied, results
        assert results[method, "control"] != denied, results
    # Replicate to PS 1 (the backup of shard 0) only from PS 0, its primary; PullShard of PS 1's own shard only
    # from its backup, PS 0 (with two PS, each is the other's backup).
    for method in ("Replicate", "PullShard"):
        assert results[method, "data"] == results[method, "control"] == results[method, "ps-1"] == denied, results
        assert results[method, "ps-0"] != denied, results
    assert log.count('"rpc_refused"') >= 3 * 2 + 2 * 3
    assert "Checkpoint is a control method; the caller (127.0.0.1, data, localhost) is not one of " \
           "cluster.control_identities" in log  # the certificate's names: its CN and SANs
    assert "Replicate is a peer method; the caller (127.0.0.1, data, localhost) is not one of " \
           "cluster.ps_identities" in log
    assert "Replicate of shard 0: only ps-0 (cluster.ps_identities) may call it, not 127.0.0.1, localhost, ps-1" in log


def test_every_method_of_every_service_has_a_role():
    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    registered = {service.name: service for service in pb.DESCRIPTOR.services_by_name.values()}
    registered["inference"] = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for name, service in registered.items():
        assert sorted(rpc.ROLES[name]) == sorted(m.name for m in service.methods), name
        for method in service.methods:
            assert isinstance(rpc.role_of(name, method.name), rpc.Role)
    assert set(rpc.ROLES) == set(registered)
    with pytest.raises(KeyError, match="EmbeddingPS.Nothing has no role"):
        rpc.guard(lambda request, context: None, "EmbeddingPS", "Nothing")
