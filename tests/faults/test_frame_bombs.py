"""Frame bombs against live services (hybridrec/core/wire/codec.py): a PS shard, an embedding worker and an NN worker,
each
a real `hybridrec serve` process, get frames of about 1 MB whose tensor tables ask for gigabytes (table entries
that all point at one lz4 block of zeros, named as each method's own tensors and otherwise). Each is refused with
INVALID_ARGUMENT naming why, the process's peak memory grows by less than 64 MiB, and it keeps serving: a
well-formed request is answered after them. On 3b8ae06 one such frame to a PS's Lookup raised its peak RSS from
395 MiB to 4,750 MiB, and the PS answered OK."""
from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from hybridrec.core.runtime import rpc
from hybridrec.app.run.ports import free_port
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.wire.frames import PSLookup, PSRows, SparseBatch
from tests.conftest import HYBRIDREC, REPO
from tests.frame_bombs import bomb

pytestmark = pytest.mark.faults

MIB = 1 << 20
SIXTEEN = [f"p{i}" for i in range(16)]
BOMBS = {  # name -> the tensor names of a frame of 256 MiB entries sharing one block
    "16 entries sharing a block": SIXTEEN,
    "a positions tensor": ["p0"],
    "an embedding frame's pos": ["pos"],
    "another name": ["x"],
}
METHODS = [("embedding_ps", "EmbeddingPS/Lookup"), ("embedding_ps", "EmbeddingPS/Update"),
           ("embedding_worker", "EmbeddingWorker/PutBatch"), ("embedding_worker", "EmbeddingWorker/Lookup"),
           ("embedding_worker", "EmbeddingWorker/PushGradients"), ("nn_worker", "NNWorker/PutBatch")]


def _peak_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.fixture
def services(tmp_path):
    addresses = {name: f"127.0.0.1:{free_port()}" for name in ("embedding_ps", "embedding_worker", "nn_worker")}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]},
        "features": [{"name": "C1", "group": 0, "dim": 8}, {"name": "C2", "group": 1, "dim": 8}],
        "ps": {"capacity": 5000, "num_stripes": 2, "shm_dir": str(tmp_path / "shm")},
        "cluster": {"ps": [addresses["embedding_ps"]], "embedding_workers": [addresses["embedding_worker"]],
                    "nn_workers": [addresses["nn_worker"]], "rendezvous": f"127.0.0.1:{free_port()}",
                    "dataloader": ["127.0.0.1:1"], "bind_host": "127.0.0.1"},
    }))
    procs = {name: subprocess.Popen(HYBRIDREC + ["serve", name, "--config", str(config), "--replica", "0"], cwd=REPO,
                                    stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{name}.log").open("wb"))
             for name in addresses}
    asyncio.run(rpc.wait_until_serving(list(addresses.values()), timeout_s=180))
    yield addresses, procs
    for proc in procs.values():
        proc.terminate()
        proc.wait(timeout=10)


async def _send_bombs(addresses: dict[str, str]) -> list[tuple[str, str, str]]:
    """Every bomb to every method: (method, bomb, what came back) of each answer that is not a refusal."""
    frames = {name: bomb(names, 256 * MIB) for name, names in BOMBS.items()}
    wrong = []
    for service, method in METHODS:
        async with rpc.channel(addresses[service]) as channel:
            call = channel.unary_unary(f"/hybridrec.{method}")
            for name, frame in frames.items():
                try:
                    await call(frame, timeout=60)
                    wrong.append((method, name, "OK"))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        wrong.append((method, name, f"{exc.code().name}: {exc.details()}"))
    return wrong


def test_frame_bombs_are_refused_by_every_service_within_64_mib_and_it_keeps_serving(services):
    addresses, procs = services
    before = {name: _peak_kib(proc.pid) for name, proc in procs.items()}
    wrong = asyncio.run(_send_bombs(addresses))
    assert not wrong, wrong
    grown = {name: (_peak_kib(proc.pid) - before[name]) / 1024 for name, proc in procs.items()}
    assert all(mib < 64 for mib in grown.values()), grown  # MiB of peak RSS each service grew by
    assert all(proc.poll() is None for proc in procs.values())

    async def still_right() -> None:
        assert all([await rpc.is_serving(address) for address in addresses.values()])
        ids = np.arange(1, 50, dtype=np.uint64)
        async with rpc.channel(addresses["embedding_ps"]) as ps, rpc.channel(addresses["embedding_worker"]) as ew:
            reply = await ps.unary_unary("/hybridrec.EmbeddingPS/Lookup")(PSLookup({8: ids}, train=True).encode(),
                                                                           timeout=30)
            assert PSRows.decode(reply, ValueCodec(), {8: 49}).rows[8].shape == (49, 8)
            cols = np.stack([ids[:20], ids[20:40]], axis=1)
            put = SparseBatch.from_columns(cols, np.ones_like(cols, dtype=bool), phase="train").encode()
            await ew.unary_unary("/hybridrec.EmbeddingWorker/PutBatch")(put, timeout=30)

    asyncio.run(still_right())


def test_a_lookup_of_10_8_ids_and_one_past_the_jobs_bound_are_refused_within_64_mib(services):
    """A PS lookup of 10^8 IDs (800 MB: on 3b8ae06 it allocated 8-34 GiB, and as a training lookup admitted the
    IDs and evicted the table) is refused by the PS's gRPC server before it is read (RESOURCE_EXHAUSTED: past
    what the job's largest request can be, `frames.max_request_bytes`); one of `frames.max_ids` + 1 IDs, which
    it does read, with INVALID_ARGUMENT naming the bound and the keys that raise it. The PS keeps serving, its
    table untouched."""
    from hybridrec.core.config import from_dict
    from hybridrec.core.wire.frames import max_ids

    addresses, procs = services
    ps = procs["embedding_ps"]
    config = from_dict(yaml.safe_load((Path(ps.args[ps.args.index("--config") + 1])).read_text()))
    bound = max_ids(config)
    huge = PSLookup({8: np.arange(1, 10 ** 8 + 1, dtype=np.uint64)}, train=True).encode()
    past = PSLookup({8: np.arange(1, bound + 2, dtype=np.uint64)}, train=True).encode()
    before = _peak_kib(ps.pid)

    async def send() -> list[grpc.aio.AioRpcError]:
        errors = []
        async with rpc.channel(addresses["embedding_ps"]) as channel:
            call = channel.unary_unary("/hybridrec.EmbeddingPS/Lookup")
            for frame in (huge, past):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(frame, timeout=120)
                errors.append(refused.value)
            reply = await call(PSLookup({8: np.arange(1, 50, dtype=np.uint64)}, train=False).encode(), timeout=30)
            assert PSRows.decode(reply, ValueCodec(), {8: 49}).rows[8].shape == (49, 8)
        return errors

    too_large, too_many = asyncio.run(send())
    assert too_large.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, too_large.details()
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"a lookup of {bound + 1} IDs, past this job's bound of {bound}" in too_many.details()
    assert "training.batch_size" in too_many.details()
    assert (_peak_kib(ps.pid) - before) / 1024 < 64
