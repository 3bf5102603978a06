"""Fuzz the data plane of running services with mutated frames (docs/architecture.md#data-plane-frames).

Real `hybridrec serve` processes (a PS shard and an embedding worker) get
>= 10,000 mutated frames. Every answer must be OK (a mutation may leave a valid
frame), INVALID_ARGUMENT, or NOT_FOUND for a well-formed
frame naming a batch the embedding worker does not hold — never INTERNAL, never a hang, never a dead
server — and both still answer SERVING and serve a valid request afterwards.
"""
from __future__ import annotations

import asyncio
import random
import struct
import subprocess
from collections import Counter

import grpc
import numpy as np
import pytest
import yaml

from hybridrec.core.runtime import rpc
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.wire.frames import BatchRef, Gradients, PSLookup, PSRows, PSUpdate, SparseBatch
from hybridrec.app.run.ports import free_port
from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.faults

NUM_FRAMES = 10_000
ENTRY = struct.Struct("<BBBBQQQ")
FIXED = 16


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    buf = bytearray(raw)
    kind = rng.randrange(9)
    if kind in (3, 4, 5) and struct.unpack_from("<H", buf, 6)[0] == 0:
        kind = 2  # a frame without tensors (BatchRef): no tensor table to lie in
    if kind == 0:  # truncated
        return bytes(buf[:rng.randrange(len(buf))])
    if kind == 1:  # header bytes flipped
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(min(len(buf), 256))] ^= 1 << rng.randrange(8)
    elif kind == 2:  # anywhere
        for _ in range(rng.randint(1, 16)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == 3:  # wrong dtype code of the first tensor
        buf[FIXED + 1] = rng.randrange(256)
    elif kind == 4:  # lying shape of the first tensor
        name_len, ndim = buf[FIXED], buf[FIXED + 3]
        if ndim:
            struct.pack_into("<Q", buf, FIXED + ENTRY.size + name_len, rng.choice([0, 1, 7, 1 << 20, 1 << 40, 2**64 - 1]))
    elif kind == 5:  # offsets and sizes
        field = rng.choice([4, 12, 20])
        struct.pack_into("<Q", buf, FIXED + field, rng.choice([0, 63, 64, 1 << 31, 2**64 - 1, rng.randrange(1 << 20)]))
    elif kind == 6:  # garbage
        return rng.randbytes(rng.randrange(1, 4096))
    elif kind == 7:  # huge declared counts in the fixed header
        struct.pack_into("<HII", buf, 6, rng.randrange(65536), rng.randrange(1 << 32), rng.randrange(1 << 32))
    else:  # meta JSON broken
        start = buf.find(b"{")
        if start > 0:
            buf[start + rng.randrange(1, 8)] = rng.randrange(256)
    return bytes(buf)


@pytest.fixture
def services(tmp_path):
    ps, ew = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]},
        "features": [{"name": "C1", "group": 0, "dim": 8}, {"name": "C2", "group": 1, "dim": 8}],
        "ps": {"capacity": 5000, "num_stripes": 2, "shm_dir": str(tmp_path / "shm")},
        "cluster": {"ps": [ps], "embedding_workers": [ew], "nn_workers": ["127.0.0.1:1"],
                    "dataloader": ["127.0.0.1:1"], "bind_host": "127.0.0.1"},
    }))
    procs = [subprocess.Popen(HYBRIDREC + ["serve", svc, "--config", str(config), "--replica", "0"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{svc}.log").open("wb"))
             for svc in ("embedding_ps", "embedding_worker")]
    asyncio.run(rpc.wait_until_serving([ps, ew], timeout_s=120))
    yield ps, ew, procs
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


def _base_frames() -> dict[str, list[bytes]]:
    ids = np.arange(1, 50, dtype=np.uint64)
    lookup = PSLookup({8: ids}, train=True).encode()
    update = PSUpdate({8: ids}, {8: np.ones((ids.size, 8), np.float32)}, update_id=1).encode(ValueCodec())
    cols = np.stack([ids[:20], ids[20:40]], axis=1)
    put = SparseBatch.from_columns(cols, np.ones_like(cols, dtype=bool), phase="train").encode()
    ew_lookup = BatchRef(12345).encode()
    push = Gradients(12345, {8: np.ones((40, 8), np.float32)}).encode(ValueCodec())
    return {"EmbeddingPS/Lookup": [lookup], "EmbeddingPS/Update": [update], "EmbeddingWorker/PutBatch": [put],
            "EmbeddingWorker/Lookup": [ew_lookup], "EmbeddingWorker/PushGradients": [push]}


# Answers that mean "refused, still serving": a malformed frame, or a well-formed one naming a batch
# the embedding worker does not hold.
EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


async def _fuzz(ps: str, ew: str) -> Counter:
    rng = random.Random(1234)
    bases = _base_frames()
    outcomes: Counter = Counter()
    async with rpc.channel(ps) as ps_ch, rpc.channel(ew) as ew_ch:
        calls = {m: (ps_ch if m.startswith("EmbeddingPS") else ew_ch).unary_unary(f"/hybridrec.{m}") for m in bases}
        methods = list(bases)
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            method = methods[i % len(methods)]
            frame = _mutate(bases[method][0], rng)
            async with sem:
                try:
                    await calls[method](frame, timeout=30)
                    outcomes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    outcomes[exc.code().name] += 1
                    if exc.code() not in EXPECTED:
                        outcomes[f"unexpected: {method} {exc.code().name} {exc.details()[:200]}"] += 1

        await asyncio.gather(*(one(i) for i in range(NUM_FRAMES)))
        # still serving, and still right
        assert await rpc.is_serving(ps) and await rpc.is_serving(ew)
        reply = await calls["EmbeddingPS/Lookup"](bases["EmbeddingPS/Lookup"][0], timeout=30)
        assert PSRows.decode(reply, ValueCodec(), {8: 49}).rows[8].shape == (49, 8)
    return outcomes


def test_ten_thousand_mutated_frames(services):
    ps, ew, procs = services
    outcomes = asyncio.run(asyncio.wait_for(_fuzz(ps, ew), timeout=600))
    unexpected = {k: v for k, v in outcomes.items() if k.startswith("unexpected")}
    assert not unexpected, unexpected
    assert outcomes["INVALID_ARGUMENT"] > NUM_FRAMES // 2, outcomes
    assert sum(v for k, v in outcomes.items() if not k.startswith("unexpected")) == NUM_FRAMES
    assert all(p.poll() is None for p in procs), "a service died"
