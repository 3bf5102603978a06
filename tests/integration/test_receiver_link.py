"""The NN worker's receiver process (services/nn_worker/receiver.py, link.py): a real receiver process makes the
trainer's lookups and pushes against a real gRPC embedding-worker server, the frames handed over in shared memory.
Every frame arrives byte for byte (one far larger than a slot's first size), errors keep their kind, a receiver
killed with calls in flight is replaced and the calls complete, and a cancelled call's slot comes back."""
from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from hybridrec import codec, rpc
from hybridrec.config import from_dict
from hybridrec.frames import Applied, BatchRef, Gradients
from services.nn_worker.link import INITIAL_SLOT_BYTES, ReceiverLink
from services.nn_worker.routing import BatchLost


class FakeEmbeddingWorker:
    """An embedding worker's data-plane methods: a frame per batch_ref, NOT_FOUND for ref 404; a lookup of a
    ref in `held` waits until the test lets it go."""

    def __init__(self):
        self.frames: dict[int, bytes] = {}
        self.pushed: dict[int, bytes] = {}
        self.held: dict[int, asyncio.Event] = {}
        self.asked: dict[int, int] = {}

    def __getattr__(self, method: str):  # the service's other methods (PutBatch, Stats) are not used here
        async def refuse(request, context):
            raise rpc.FailedPrecondition(f"{method} is not in this test")
        return refuse

    async def Lookup(self, request, context):
        ref = BatchRef.decode(request).batch_ref
        self.asked[ref] = self.asked.get(ref, 0) + 1
        if ref in self.held:
            await self.held[ref].wait()
        if ref not in self.frames:
            raise rpc.NotFound(f"batch {ref} is not held")
        return self.frames[ref]

    async def PushGradients(self, request, context):
        ref = Gradients.batch_ref_of(request)
        self.pushed[ref] = request
        return Applied(applied=7, lives=((0, 3), (1, (1 << 64) - 5))).encode()  # lives are 64-bit


def _frame(ref: int, nbytes: int) -> bytes:
    rng = np.random.default_rng(ref)
    return codec.encode({"x": rng.integers(0, 255, nbytes, dtype=np.uint8)}, {"batch_ref": ref})


@pytest.fixture
def worker_and_config():
    async def start():
        rpc.use_tls(None)
        server = rpc.new_server()
        fake = FakeEmbeddingWorker()
        rpc.add_service(server, "EmbeddingWorker", fake)
        port = rpc.bind(server, "127.0.0.1", 0)
        await server.start()
        config = from_dict({"data": {"train": ["x"]}, "num_dense": 3,
                            "features": [{"name": "a", "group": 0, "dim": 4}],
                            "cluster": {"embedding_workers": [f"127.0.0.1:{port}"], "nn_workers": ["a:1"],
                                        "retry_s": 5.0},
                            "training": {"receiver": True}})
        return server, fake, config
    return start


def test_frames_arrive_whole_and_errors_keep_their_kind(worker_and_config):
    async def scenario():
        server, fake, config = await worker_and_config()
        link = ReceiverLink(config, 0)
        try:
            fake.frames = {1: _frame(1, 1000), 2: _frame(2, 3 * INITIAL_SLOT_BYTES), 3: _frame(3, 10)}
            looked = await asyncio.gather(*(link.lookup(ref) for ref in (1, 2, 3)))
            for ref, got in zip((1, 2, 3), looked):
                assert bytes(got.frame) == fake.frames[ref]
            grown = bytes(looked[1].frame)
            for got in looked:
                got.release()
            # A slot that grew is mapped again by both sides: the next frame in it is read whole as well.
            fake.frames[4] = _frame(4, 2 * INITIAL_SLOT_BYTES + 5)
            again = [await link.lookup(4) for _ in range(3)]
            assert all(bytes(a.frame) == fake.frames[4] for a in again) and grown == fake.frames[2]

            tensors = {"grad.4": np.arange(40, dtype=np.float32).reshape(10, 4)}
            applied = await link.push(9, tensors)
            assert applied.applied == 7 and applied.lives == ((0, 3), (1, (1 << 64) - 5))
            assert fake.pushed[9] == Gradients.encode_packed(9, tensors)

            with pytest.raises(BatchLost, match="batch 404 is not held"):
                await link.lookup(404)
            assert link.replaced == 0 and len(link.free) == len(link.slots) - 3  # the 3 lookups of ref 4 held
        finally:
            await link.close()
            await server.stop(None)
        assert link.process.returncode == 0  # the receiver saw its link close and exited
    asyncio.run(scenario())


def test_a_killed_receiver_is_replaced_and_its_calls_complete(worker_and_config):
    async def scenario():
        server, fake, config = await worker_and_config()
        link = ReceiverLink(config, 0)
        try:
            fake.frames = {5: _frame(5, 200_000), 6: _frame(6, 300)}
            fake.held = {5: asyncio.Event()}
            pending = asyncio.ensure_future(link.lookup(5))
            while fake.asked.get(5, 0) < 1:  # the first receiver is inside the call
                await asyncio.sleep(0.01)
            first = link.process.pid
            os.kill(first, signal.SIGKILL)
            while fake.asked.get(5, 0) < 2:  # its replacement asked again
                await asyncio.sleep(0.01)
            fake.held[5].set()
            looked = await asyncio.wait_for(pending, 30)
            assert bytes(looked.frame) == fake.frames[5]
            assert link.replaced == 1 and link.process.pid != first
            assert bytes((await link.lookup(6)).frame) == fake.frames[6]

            # A cancelled lookup's slot comes back once the receiver has answered, not before.
            fake.held = {6: asyncio.Event()}
            asked = fake.asked[6]
            cancelled = asyncio.ensure_future(link.lookup(6))
            while fake.asked[6] == asked:
                await asyncio.sleep(0.01)
            free = len(link.free)
            cancelled.cancel()
            await asyncio.sleep(0.05)
            assert len(link.free) == free
            fake.held[6].set()
            while len(link.free) == free:
                await asyncio.sleep(0.01)
            assert not link.pending
        finally:
            await link.close()
            await server.stop(None)
    asyncio.run(scenario())
