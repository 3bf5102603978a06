"""Control RPCs take no path from the network, and with mTLS only authorised identities may call them.

Real `hybridrec serve embedding_ps` processes: Checkpoint and LoadCheckpoint
requests naming absolute paths, `..` segments or a symlink that leaves the
checkpoint root are refused with PERMISSION_DENIED, nothing is written or read
outside the root, and the PS keeps serving. With cluster.control_identities,
a valid certificate of another identity may look rows up but not checkpoint.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from hybridrec.core.runtime import rpc
from hybridrec.core.config import TLSConfig
from hybridrec.core.wire.proto import pb
from tests.faults.ps_process import lookup_status, ps_process
from tests.faults.test_tls import _issue, _write

pytestmark = pytest.mark.faults


async def _call(channel, method: str, name: str) -> grpc.StatusCode:
    call = rpc.control_method(channel, "EmbeddingPS", method)
    try:
        await call(pb.CheckpointRequest(name=name, step=1), timeout=60)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_checkpoint_names_cannot_leave_the_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    with ps_process(tmp_path) as (address, ps):
        async def scenario() -> dict[str, grpc.StatusCode]:
            await rpc.wait_until_serving([address], timeout_s=120)
            (tmp_path / "root" / "link").symlink_to(outside, target_is_directory=True)
            results = {}
            async with rpc.channel(address) as ch:
                for method in ("Checkpoint", "LoadCheckpoint"):
                    for name in (str(outside), "../outside", "ok/../../outside", "link", "link/inner", ""):
                        results[f"{method} {name!r}"] = await _call(ch, method, name)
                results["lookup after"] = await lookup_status(ch)
                results["valid checkpoint"] = await _call(ch, "Checkpoint", "step-00000001.tmp")
            return results

        results = asyncio.run(scenario())
    assert results.pop("lookup after") == grpc.StatusCode.OK
    assert results.pop("valid checkpoint") == grpc.StatusCode.OK
    assert all(code == grpc.StatusCode.PERMISSION_DENIED for code in results.values()), results
    assert list(outside.iterdir()) == [], "a refused request wrote outside the root"
    assert (tmp_path / "root" / "step-00000001.tmp" / "ps").is_dir()
    assert ps.returncode == 0, "the PS did not stop cleanly after the refused requests"


@pytest.fixture
def identities(tmp_path):
    ca_key, ca_cert = _issue("hybridrec test CA", None, None, ca=True)
    _write(tmp_path, "ca", ca_key, ca_cert)
    for name in ("service", "nn-worker", "intruder"):
        key, cert = _issue(name, ca_key, ca_cert.subject, ca=False)
        _write(tmp_path, name, key, cert)
    return tmp_path


def test_only_authorised_identities_call_control_methods(tmp_path, identities):
    def tls(name: str) -> dict:
        return {"ca": str(identities / "ca.pem"), "cert": str(identities / f"{name}.pem"),
                "key": str(identities / f"{name}.key")}

    with ps_process(tmp_path, tls=tls("service"), control_identities=["nn-worker"]) as (address, _):
        async def scenario() -> dict[str, grpc.StatusCode]:
            results = {}
            for who in ("intruder", "nn-worker"):
                rpc.use_tls(TLSConfig(**tls(who)))
                await rpc.wait_until_serving([address], timeout_s=120)
                async with rpc.channel(address) as ch:
                    results[f"{who} lookup"] = await lookup_status(ch)
                    results[f"{who} checkpoint"] = await _call(ch, "Checkpoint", f"by-{who}")
            return results

        results = asyncio.run(scenario())
    assert results == {"intruder lookup": grpc.StatusCode.OK, "intruder checkpoint": grpc.StatusCode.PERMISSION_DENIED,
                       "nn-worker lookup": grpc.StatusCode.OK, "nn-worker checkpoint": grpc.StatusCode.OK}, results
    assert not (tmp_path / "root" / "by-intruder").exists() and (tmp_path / "root" / "by-nn-worker" / "ps").is_dir()
    log = (tmp_path / "ps.log").read_text()
    assert "rpc_refused" in log and "intruder" in log
