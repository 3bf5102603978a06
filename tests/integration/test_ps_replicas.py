"""`ps.replicas: 2` with two real PS processes: every update is on both copies of its shard, a backup that
was down catches up, and what does not fit is refused (services/embedding_ps/replica.py).

The updates are sent straight to the shards, as an embedding worker does; each copy is read back with
PullShard (the primary's copy and the backup's) and compared row for row, optimizer state included.
"""
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
from hybridrec.core.wire.frames import PSLookup, PSUpdate, ShardPull, ShardRows, update_id
from hybridrec.core.wire.proto import pb
from hybridrec.core.wire.sharding import shard_of
from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration

DIM, ROW_WIDTH = 8, 16  # adagrad keeps one accumulator per value
VALUES = ValueCodec(fp16=False)


def _config(tmp_path: Path, addresses: list[str], replicas: int) -> Path:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": DIM}],
        "optimizer": {"embedding": {"name": "adagrad", "lr": 0.1}},
        "ps": {"capacity": 100_000, "num_stripes": 2, "shm_dir": str(tmp_path / "shm"), "replicas": replicas},
        "cluster": {"ps": addresses, "bind_host": "127.0.0.1"},
    }))
    return config


class Cluster:
    """Two PS processes of one job; `start(i)` and `kill(i)` one of them."""

    def __init__(self, tmp_path: Path, replicas: int = 2):
        self.tmp_path = tmp_path
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        self.config = _config(tmp_path, self.addresses, replicas)
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--config", str(self.config),
                                                      "--replica", str(i)], cwd=REPO, stdout=subprocess.DEVNULL,
                                         stderr=(self.tmp_path / f"ps-{i}.log").open("ab"))

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


@contextlib.contextmanager
def cluster(tmp_path: Path, replicas: int = 2):
    c = Cluster(tmp_path, replicas)
    try:
        for i in range(2):
            c.start(i)
        yield c
    finally:
        c.stop()


def _ids_of(shard: int, n: int, seed: int) -> np.ndarray:
    ids = np.unique(np.random.default_rng(seed).integers(1, 1 << 40, 4 * n).astype(np.uint64))
    return ids[shard_of(ids, 2) == shard][:n]


async def _train(channel: grpc.aio.Channel, shard: int, steps: int, seed: int, ids_seed: int | None = None,
                 width: int = 500, cycle: int | None = None) -> None:
    """A train lookup (admits the rows) and an update per step, as an embedding worker sends them; `ids_seed`
    and `cycle`: the IDs of the first `cycle` steps of an earlier `_train`, over and over (rows updated again)."""
    lookup = rpc.raw_method(channel, "EmbeddingPS", "Lookup")
    update = rpc.raw_method(channel, "EmbeddingPS", "Update")
    for step in range(steps):
        ids = _ids_of(shard, width, (seed if ids_seed is None else ids_seed) * 1000 + step % (cycle or steps))
        await lookup(PSLookup({DIM: ids}, train=True).encode(), timeout=30)
        grads = np.random.default_rng(step).standard_normal((ids.size, DIM)).astype(np.float32)
        await update(PSUpdate({DIM: ids}, {DIM: grads}, update_id(seed << 56 | 1, step + 1)).encode(VALUES),
                     timeout=30)


async def _copy(channel: grpc.aio.Channel, shard: int, copy: str) -> tuple[int, int, dict[int, np.ndarray]]:
    """(life, seq, key -> whole row) of a copy of `shard`, read page by page."""
    pull = rpc.raw_method(channel, "EmbeddingPS", "PullShard")
    first = ShardRows.decode(await pull(ShardPull(shard, copy).encode(), timeout=60), {DIM: ROW_WIDTH})
    rows, page = {}, first
    for i in range(first.pages):
        if i:
            page = ShardRows.decode(await pull(ShardPull(shard, copy, i, copy_id=first.copy_id).encode(), timeout=60),
                                    {DIM: ROW_WIDTH})
        for keys, values in page.rows.values():
            rows.update(zip(keys.tolist(), values.copy()))
    return first.life, first.seq, rows


async def _stats(channel: grpc.aio.Channel) -> dict[str, float]:
    return dict((await rpc.control_method(channel, "EmbeddingPS", "Stats")(pb.Empty(), timeout=30)).values)


async def _until_in_sync(channel: grpc.aio.Channel, seq: int | None) -> dict[str, float]:
    """Stats once the backup on `channel` is in sync (at `seq`, unless None)."""
    for _ in range(600):
        stats = await _stats(channel)
        if stats.get("backup_in_sync") == 1.0 and seq in (None, stats.get("backup_seq")):
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"the backup did not catch up to seq {seq}: {stats}")


def _same(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> None:
    assert a.keys() == b.keys(), (len(a), len(b), len(a.keys() ^ b.keys()))
    for key, row in a.items():
        np.testing.assert_array_equal(row, b[key], err_msg=f"row {key}")


def test_every_update_is_on_both_copies_and_a_backup_that_was_down_catches_up(tmp_path):
    async def main() -> None:
        with cluster(tmp_path) as c:
            await rpc.wait_until_serving(c.addresses, timeout_s=120, what="PS shards")
            ch = [rpc.channel(a) for a in c.addresses]
            await _until_in_sync(ch[0], 0)  # each backup copied its (still empty) primary at start
            await _until_in_sync(ch[1], 0)
            await asyncio.gather(_train(ch[0], 0, 20, seed=1), _train(ch[1], 1, 20, seed=2))
            for shard, primary, keeper in ((0, ch[0], ch[1]), (1, ch[1], ch[0])):
                life, seq, rows = await _copy(primary, shard, "primary")
                b_life, b_seq, b_rows = await _copy(keeper, shard, "backup")
                assert (life, seq) == (b_life, b_seq) and seq == 20
                _same(rows, b_rows)  # values and optimizer state, row for row
                assert len(rows) > 9000

            # The PS keeping shard 0's backup goes down; shard 0 trains on unreplicated (80,000 more rows: a copy
            # of it takes two pages); the backup comes back and catches up.
            c.kill(1)
            await _train(ch[0], 0, 10, seed=3, width=8000)
            assert (await _stats(ch[0]))["replica_shipments_failed_total"] == 10
            c.start(1)
            await rpc.wait_until_serving(c.addresses[1:], timeout_s=120, what="PS 1")
            await _until_in_sync(ch[1], 30)
            # Catching up while shard 0 updates the same rows again: a row shipped after the copy was taken must
            # win over the copy's. The backup is told to start over (what a primary that loaded a checkpoint
            # sends) while shard 0 updates each of those rows once more, until a catch-up had shipments arrive
            # during it; every time, both copies must end equal.
            replicate = rpc.raw_method(ch[1], "EmbeddingPS", "Replicate")
            for attempt in range(20):
                await replicate(ShardRows(0, 0, 0, {}).encode(), timeout=30)
                await _train(ch[0], 0, 10, seed=10 + attempt, ids_seed=3, width=8000)
                _, seq, rows = await _copy(ch[0], 0, "primary")
                await _until_in_sync(ch[1], seq)
                _, b_seq, b_rows = await _copy(ch[1], 0, "backup")
                assert b_seq == seq
                _same(rows, b_rows)
                last = [line for line in (tmp_path / "ps-1.log").read_text().splitlines()
                        if '"backup_in_sync"' in line and '"shard": 0' in line][-1]
                if '"shipped_meanwhile": 0' not in last:
                    break
            else:
                raise AssertionError(f"no catch-up had shipments arrive during it: {last}")
            assert '"pages": 2' in last, last
            await _train(ch[0], 0, 5, seed=5)  # and it stays in sync with what follows
            await _until_in_sync(ch[1], seq + 5)
            _, seq, rows = await _copy(ch[0], 0, "primary")
            _, b_seq, b_rows = await _copy(ch[1], 0, "backup")
            assert seq == b_seq
            _same(rows, b_rows)
            for channel in ch:
                await channel.close()

    asyncio.run(main())


def test_what_does_not_fit_is_refused_and_the_shard_keeps_serving(tmp_path):
    async def main() -> None:
        with cluster(tmp_path) as c:
            await rpc.wait_until_serving(c.addresses, timeout_s=120, what="PS shards")
            ch = rpc.channel(c.addresses[1])  # PS 1: shard 1, and the backup of shard 0
            await _until_in_sync(ch, 0)
            replicate = rpc.raw_method(ch, "EmbeddingPS", "Replicate")
            pull = rpc.raw_method(ch, "EmbeddingPS", "PullShard")
            ids = _ids_of(1, 3, 0)
            refusals = [
                # rows of a shard whose backup this PS does not keep
                (replicate(ShardRows(1, 5, 1, {DIM: (ids, np.ones((3, ROW_WIDTH), np.float32))}).encode(), timeout=30),
                 grpc.StatusCode.INVALID_ARGUMENT, "not of shard 1"),
                # rows without their optimizer state
                (replicate(ShardRows(0, 5, 1, {DIM: (ids, np.ones((3, DIM), np.float32))}).encode(), timeout=30),
                 grpc.StatusCode.INVALID_ARGUMENT, "has shape"),
                (replicate(b"not a frame", timeout=30), grpc.StatusCode.INVALID_ARGUMENT, ""),
                # another job's PS on a reused address: neither its rows nor a copy for it
                (replicate(ShardRows(0, 5, 1, {}, job="other-job").encode(), timeout=30),
                 grpc.StatusCode.FAILED_PRECONDITION, "comes from job 'other-job'; this PS serves job ''"),
                (pull(ShardPull(1, "primary", job="other-job").encode(), timeout=30),
                 grpc.StatusCode.FAILED_PRECONDITION, "comes from job 'other-job'"),
                (pull(ShardPull(0, "backup", job="other-job").encode(), timeout=30),
                 grpc.StatusCode.FAILED_PRECONDITION, "comes from job 'other-job'"),
                # the backup of shard 0 follows another life than the one asked for
                (pull(ShardPull(0, "backup", 0, life=12345).encode(), timeout=30), grpc.StatusCode.FAILED_PRECONDITION,
                 "not the lost life 12345"),
                (pull(ShardPull(0, "primary").encode(), timeout=30), grpc.StatusCode.INVALID_ARGUMENT,
                 "this is shard 1"),
                (pull(ShardPull(1, "primary", 3).encode(), timeout=30), grpc.StatusCode.FAILED_PRECONDITION,
                 "page 0 first"),
            ]
            for call, code, words in refusals:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == code and words in err.value.details(), err.value
            stats = await _stats(ch)
            assert stats["backup_in_sync"] == 1.0  # none of it touched the backup
            await _train(ch, 1, 2, seed=5)  # and the shard serves on
            await ch.close()

    asyncio.run(main())


def test_a_ps_without_replicas_refuses_shipments(tmp_path):
    async def main() -> None:
        with cluster(tmp_path, replicas=1) as c:
            await rpc.wait_until_serving(c.addresses, timeout_s=120, what="PS shards")
            ch = rpc.channel(c.addresses[1])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc.raw_method(ch, "EmbeddingPS", "Replicate")(ShardRows(0, 5, 1, {}).encode(), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ps.replicas is 1" in err.value.details()
            stats = await _stats(ch)
            assert "backup_in_sync" not in stats and "replica_shipments_total" not in stats
            await ch.close()

    asyncio.run(main())
