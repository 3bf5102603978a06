"""Read-only PS shards serving an exported bundle: real processes, real gRPC, the training PS's protocol."""
from __future__ import annotations

import asyncio
import os
import signal
import shutil
import subprocess
import time

import grpc
import numpy as np
import pytest

from hybridrec.core.runtime import rpc
from hybridrec.core.layouts.bundle import open_bundle
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.wire.frames import PSLookup, PSRows, PSUpdate
from hybridrec.app.run.ports import free_port
from hybridrec.core.wire.proto import pb
from hybridrec.core.wire.sharding import shard_of
from tests.conftest import HYBRIDREC, REPO
from tests.faults.test_tls import pki  # noqa: F401 - a fixture
from tests.unit.test_export import make_checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readonly")
    run, _, _, _ = make_checkpoint(tmp)
    out = tmp / "bundle"
    result = subprocess.run(HYBRIDREC + ["export", str(run), "--out", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def bundle(exported, tmp_path):
    """A copy of the module's exported bundle for each test: one of them corrupts its copy."""
    return shutil.copytree(exported, tmp_path / "bundle")


def _start(bundle, replica, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / f"ps-{replica}.log", "wb")
    proc = subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--bundle", str(bundle), "--replica", str(replica),
                                         "--listen", address], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HYBRIDREC_LOG_JSON": "1"})
    return proc, address


def test_two_read_only_shards_answer_the_bundles_rows(tmp_path, bundle):
    manifest, table = open_bundle(bundle)
    procs = [_start(bundle, replica, tmp_path) for replica in range(manifest.num_shards)]
    try:
        asyncio.run(_check(manifest, table, [address for _, address in procs]))
        assert all(proc.poll() is None for proc, _ in procs), "a read-only PS died"
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            assert proc.wait(timeout=20) == 0


async def _check(manifest, table, addresses):
    await rpc.wait_until_serving(addresses, timeout_s=60, what="read-only PS")
    rng = np.random.default_rng(5)
    codec = ValueCodec(fp16=False)
    for shard, address in enumerate(addresses):
        async with rpc.channel(address) as channel:
            lookup = rpc.raw_method(channel, "EmbeddingPS", "Lookup")
            ids = {}
            for dim in manifest.widths:
                known = np.asarray(table.shards[shard].keys[dim])[::7]
                unknown = rng.integers(1 << 52, 1 << 53, 400, dtype=np.uint64)
                unknown = unknown[shard_of(unknown, manifest.num_shards) == shard]
                ids[dim] = rng.permutation(np.concatenate([known, unknown]))
                assert known.size > 100 and unknown.size > 100
            for train in (False, True):  # a "train" lookup reads too: nothing is inserted
                reply = await lookup(PSLookup(ids, train=train).encode(), timeout=30)
                rows = PSRows.decode(reply, codec, {d: v.shape[0] for d, v in ids.items()}).rows
                for dim, got in rows.items():
                    np.testing.assert_array_equal(got, table.lookup(dim, ids[dim]))
                    unknown = ~np.isin(ids[dim], np.asarray(table.shards[shard].keys[dim]))
                    assert unknown.sum() > 100 and not got[unknown].any()  # unknown IDs read zeros
            other = rng.integers(1, 1 << 50, 200, dtype=np.uint64)
            other = other[shard_of(other, manifest.num_shards) != shard]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await lookup(PSLookup({manifest.widths[0]: other}).encode(), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "another shard" in err.value.details()
            dim = manifest.widths[0]
            update = PSUpdate({dim: ids[dim]}, {dim: np.ones((ids[dim].size, dim), np.float32)}, update_id=1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc.raw_method(channel, "EmbeddingPS", "Update")(update.encode(codec), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "read-only" in err.value.details()
            for method, request in (("Checkpoint", pb.CheckpointRequest(name="step-00000001", step=1)),
                                    ("LoadCheckpoint", pb.CheckpointRequest(name="step-00000001", step=1)),
                                    ("Publish", pb.PublishRequest(version=1, full=True))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await rpc.control_method(channel, "EmbeddingPS", method)(request, timeout=30)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, method
            # still serving, and the rows did not change
            reply = await lookup(PSLookup(ids).encode(), timeout=30)
            rows = PSRows.decode(reply, codec, {d: v.shape[0] for d, v in ids.items()}).rows
            for dim, got in rows.items():
                np.testing.assert_array_equal(got, table.lookup(dim, ids[dim]))
            assert await rpc.is_serving(address)
            stats = await rpc.control_method(channel, "EmbeddingPS", "Stats")(pb.Empty(), timeout=30)
            for dim in manifest.widths:
                assert stats.values[f"dim{dim}_rows"] == table.shards[shard].keys[dim].shape[0]
            assert stats.values["refused_total"] == 4 and stats.values["lookups_total"] == 3  # Update + 3 control


def test_a_corrupt_bundle_or_a_missing_shard_exits_2_naming_the_file(tmp_path, bundle):
    started = time.monotonic()
    result = subprocess.run(HYBRIDREC + ["serve", "embedding_ps", "--bundle", str(bundle), "--replica", "2"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "replica 2 does not exist" in result.stderr
    rows = next(bundle.glob("embeddings/shard-00001-of-00002/dim8.rows.npy"))
    data = bytearray(rows.read_bytes())
    data[-1] ^= 0xFF
    rows.write_bytes(bytes(data))
    result = subprocess.run(HYBRIDREC + ["serve", "embedding_ps", "--bundle", str(bundle), "--replica", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and str(rows) in result.stderr and "sha256" in result.stderr
    assert time.monotonic() - started < 60


def test_read_only_shard_with_mutual_tls(tmp_path, bundle, pki):
    from hybridrec.core.config import TLSConfig

    address = f"127.0.0.1:{free_port()}"
    tls = [str(pki / "ca.pem"), str(pki / "service.pem"), str(pki / "service.key")]
    proc = subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--bundle", str(bundle), "--replica", "1",
                                         "--listen", address, *(a for path in tls for a in ("--tls", path))],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp_path / "ps.log").open("wb"))
    manifest, table = open_bundle(bundle)
    ids = np.asarray(table.shards[1].keys[4])[:50]

    async def scenario():
        rpc.use_tls(TLSConfig(ca=tls[0], cert=tls[1], key=tls[2]))
        try:
            await rpc.wait_until_serving([address], timeout_s=60)
            async with rpc.channel(address) as channel:
                reply = await rpc.raw_method(channel, "EmbeddingPS", "Lookup")(PSLookup({4: ids}).encode(), timeout=30)
        finally:
            rpc.use_tls(None)
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await channel.unary_unary("/hybridrec.EmbeddingPS/Lookup")(PSLookup({4: ids}).encode(), timeout=10)
        return PSRows.decode(reply, ValueCodec(fp16=False), {4: ids.size}).rows[4]

    try:
        np.testing.assert_array_equal(asyncio.run(scenario()), table.lookup(4, ids))
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
