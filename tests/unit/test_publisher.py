"""NN worker rank 0's Publisher against fake PS shards: full every full_every, deltas on the last complete version,
a full snapshot when a shard refuses a delta, at most one publish in flight (skips counted), a failed version
removed and followed by a full one, compaction, the final version at the end."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from hybridrec.core.config import from_dict
from hybridrec.core.wire.proto import pb
from hybridrec.core.wire.sharding import shard_of
from hybridrec.core.layouts.versions import Follower, list_versions, version_dir, write_table
from services.nn_worker.publish import Publisher


class FakeShards:
    """Two PS shards writing two rows per version (keys 2v and 2v+1, each on its shard) and remembering what they were asked."""

    def __init__(self, root):
        self.root, self.calls, self.refuse_delta, self.fail, self.gate = root, [], False, False, None

    async def __call__(self, version: int, full: bool, base: int | None) -> list[pb.PublishReply]:
        self.calls.append((version, full, base))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("disk full")
        if self.refuse_delta and not full:
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, details="shard 1 restarted")
        replies = []
        keys = np.array([2 * version, 2 * version + 1], np.uint64)
        owner = shard_of(keys, 2)
        for shard in range(2):
            mine = keys[owner == shard]
            files = write_table(version_dir(self.root, version), shard, 2, 4, mine,
                                np.full((mine.size, 4), version, np.float32))
            replies.append(pb.PublishReply(rows=mine.size, rows_by_dim={4: mine.size}, files=[
                pb.PublishedFile(path=k, bytes=e.bytes, sha256=e.sha256) for k, e in files.items()]))
        return replies


def make(tmp_path, **publish):
    config = from_dict({"data": {"train": ["x"]}, "features": [{"name": "a", "group": 0, "dim": 4}],
                        "num_dense": 3, "cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2"]},
                        "publish": {"dir": str(tmp_path / "v"), **publish}})
    publisher = Publisher(config, torch.nn.Linear(3, 1), ThreadPoolExecutor(1))
    shards = FakeShards(publisher.root)
    publisher._ps_publish = lambda version, full: shards(version, full, publisher.base if not full else None)
    return publisher, shards


def test_full_every_deltas_refusals_failures_and_the_final_version(tmp_path):
    async def go():
        publisher, shards = make(tmp_path, interval_steps=10, full_every=3, keep=1)
        for step in range(1, 41):
            await publisher.maybe_publish(step)
            await publisher.task if publisher.task else None
        assert [c[:2] for c in shards.calls] == [(1, True), (2, False), (3, False), (4, True)]
        assert shards.calls[1][2] == 1 and shards.calls[2][2] == 2
        shards.refuse_delta = True  # a shard lost its change log: the version is written in full
        await publisher.maybe_publish(50)
        await publisher.task
        assert shards.calls[-2:] == [(5, False, 4), (5, True, None)]
        shards.refuse_delta, shards.fail = False, True
        await publisher.maybe_publish(60)
        await publisher.task
        assert not version_dir(publisher.root, 6).exists() and publisher.stats.failed == 1
        shards.fail = False
        await publisher.maybe_publish(70)
        await publisher.task
        assert shards.calls[-1] == (7, True, None)  # after a failure: full
        await publisher.finish(75)
        assert shards.calls[-1] == (8, False, 7) and publisher.stats.last_step == 75
        await publisher.finish(75)  # one final version only
        return publisher

    publisher = asyncio.run(go())
    s = publisher.summary()
    assert (s.published, s.full, s.failed, s.skipped, s.last_version) == (7, 4, 1, 0, 8)
    assert s.mean_s is not None and s.max_s >= s.mean_s and s.directory == str(publisher.root)
    versions, other = list_versions(publisher.root)
    assert [v.version for v in versions] == [7, 8] and not other  # compacted: keep=1, newest full is 7
    snapshot = Follower(publisher.root).poll()
    assert snapshot.version == 8 and snapshot.step == 75 and snapshot.manifest.base_version == 7
    assert snapshot.table.lookup(4, np.array([16, 17, 14], np.uint64))[:, 0].tolist() == [8.0, 8.0, 7.0]
    assert torch.equal(snapshot.dense_state["weight"], publisher.model.weight.detach())
    assert publisher.metrics()["versions_published_total"] == 7


def test_at_most_one_publish_in_flight(tmp_path):
    async def go():
        publisher, shards = make(tmp_path, interval_steps=1)
        shards.gate = asyncio.Event()
        await publisher.maybe_publish(1)
        await asyncio.sleep(0)
        await publisher.maybe_publish(2)
        await publisher.maybe_publish(3)
        assert publisher.stats.skipped == 2 and len(shards.calls) == 1
        shards.gate.set()
        await publisher.task
        await publisher.maybe_publish(4)
        await publisher.task
        return publisher, shards

    publisher, shards = asyncio.run(go())
    assert [c[0] for c in shards.calls] == [1, 2] and publisher.stats.published == 2


def test_a_restarted_job_goes_on_numbering_and_starts_with_a_full_version(tmp_path):
    async def go():
        first, _ = make(tmp_path, interval_steps=1)
        await first.maybe_publish(1)
        await first.task
        second, shards = make(tmp_path, interval_steps=1)
        await second.maybe_publish(2)
        await second.task
        return shards

    assert asyncio.run(go()).calls == [(2, True, None)]


def test_interval_s_triggers_by_time(tmp_path):
    async def go():
        publisher, shards = make(tmp_path, interval_s=0.2)
        await publisher.maybe_publish(1)  # too early
        await asyncio.sleep(0.25)
        await publisher.maybe_publish(2)
        await publisher.task
        await publisher.maybe_publish(3)  # the clock restarted with the last publish
        return shards

    assert [c[0] for c in asyncio.run(go()).calls] == [1]


def test_a_time_interval_waits_for_a_version_that_overran_it(tmp_path):
    """interval_s: a version still being written when the interval comes is waited for (not counted as
    skipped); one that took longer than the interval starts the next interval when it is complete, so two
    versions are never written back to back (a follower polling every 0.2 s would merge them into one swap)."""
    async def go():
        publisher, shards = make(tmp_path, interval_s=0.2)
        shards.gate = asyncio.Event()
        await asyncio.sleep(0.25)
        await publisher.maybe_publish(1)
        await asyncio.sleep(0.3)
        await publisher.maybe_publish(2)  # its interval has passed, the version is still being written
        assert publisher.stats.skipped == 0 and len(shards.calls) == 1
        shards.gate.set()
        await publisher.task
        await publisher.maybe_publish(3)  # complete now, but it overran: the next interval starts now
        assert len(shards.calls) == 1
        await asyncio.sleep(0.25)
        await publisher.maybe_publish(4)
        await publisher.task
        return publisher, shards

    publisher, shards = asyncio.run(go())
    assert [c[0] for c in shards.calls] == [1, 2] and publisher.stats.published == 2
