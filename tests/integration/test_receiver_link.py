"""The NN worker's receiver process (services/nn_worker/receiver/process.py, link.py): a real receiver process makes the
trainer's lookups and pushes against a real gRPC embedding-worker server, the frames handed over in shared memory.
Every frame arrives checked and whole (one far larger than a slot's first size), a bad one fails its lookup,
errors keep their kind, a receiver killed with calls in flight is replaced and the calls complete, and a cancelled
call's slot comes back. The NN worker's own server, in the receiver, hands every call to the trainer's handlers."""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from hybridrec.core.runtime import rpc
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import from_dict
from hybridrec.core.wire.frames import Applied, BatchRef, Consumed, DenseBatch, Embeddings, EndOfPhase, Gradients
from hybridrec.core.wire.jagged import KeyedBags
from hybridrec.core.model.pooling import Pooler
from hybridrec.core.wire.proto import pb
from services.nn_worker import admission
from services.nn_worker.inbox import Inbox
from services.nn_worker.ledger import Ledger
from services.nn_worker.receiver import link
from services.nn_worker.receiver.link import INITIAL_SLOT_BYTES
from services.nn_worker.receiver.receiver_link import ReceiverLink
from services.nn_worker.routing import BatchLost, Looked
from services.nn_worker.server import NNWorkerServicer


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


BATCH = 4096  # with max_len 4096, frames of up to 32 MB of positions fit the batch's bound
VALUES = ValueCodec()


def _frame(ref: int, nbytes: int) -> bytes:
    """A lookup's answer: an `Embeddings` frame of the test's one 4-wide feature for a batch of `BATCH`, its
    multi-hot bags long enough for about `nbytes`."""
    rng = np.random.default_rng(ref)
    elements = max(BATCH, nbytes // 2)
    lengths = np.full((1, BATCH), elements // BATCH, np.uint16)
    lengths[0, :elements % BATCH] += 1
    rows = rng.standard_normal((1000, 4)).astype(np.float32)
    pos = rng.integers(0, rows.shape[0], elements).astype(np.uint16)
    return Embeddings(KeyedBags(pos, lengths), np.array([rows.shape[0]], np.int32), {4: rows}).encode(VALUES)


def _assert_same(looked, frame: bytes) -> None:
    """What the trainer takes from the receiver's slot is the embedding worker's frame, checked: the same
    arrays as decoding that frame in the trainer."""
    assert looked.checked
    pooler = Pooler(CONFIG_FEATURES, VALUES)
    got, sent = pooler.from_checked(looked.frame, BATCH), pooler.decode(frame, BATCH)
    for got_array, sent_array in ((got.pos, sent.pos), (got.lengths, sent.lengths), (got.start, sent.start),
                                  (got.base, sent.base)):
        np.testing.assert_array_equal(got_array, sent_array)
    np.testing.assert_array_equal(got.rows[4].half, sent.rows[4].half)
    np.testing.assert_array_equal(got.rows[4].norms, sent.rows[4].norms)


FEATURES = [{"name": "a", "group": 0, "dim": 4, "pooling": "mean", "kind": "list", "max_len": 4096}]
"""One multi-hot feature whose bags are as long as a frame of the size a test wants needs (`_frame`): a
sample's bag is at most max_len long, so a batch's frame at most BATCH x max_len positions."""
CONFIG_FEATURES = from_dict({"data": {"train": ["x"], "format": "parquet"}, "features": FEATURES}).features


@pytest.fixture
def worker_and_config():
    async def start():
        rpc.use_tls(None)
        server = rpc.new_server()
        fake = FakeEmbeddingWorker()
        rpc.add_service(server, "EmbeddingWorker", fake)
        port = rpc.bind(server, "127.0.0.1", 0)
        await server.start()
        config = from_dict({"data": {"train": ["x"], "format": "parquet"}, "num_dense": 3, "features": FEATURES,
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
            looked = await asyncio.gather(*(link.lookup(ref, BATCH) for ref in (1, 2, 3)))
            assert len(looked[1].frame) > 3 * INITIAL_SLOT_BYTES
            for ref, got in zip((1, 2, 3), looked):
                _assert_same(got, fake.frames[ref])
            grown = bytes(looked[1].frame)
            for got in looked:
                got.release()
                got.release()  # once only
            assert len(link.free) == len(link.slots) == 3
            # A slot that grew is mapped again by both sides: the next frame in it is read whole as well.
            fake.frames[4] = _frame(4, 2 * INITIAL_SLOT_BYTES + 5)
            again = [await link.lookup(4, BATCH) for _ in range(3)]
            for got in again:
                _assert_same(got, fake.frames[4])
            _assert_same(Looked(grown, checked=True), fake.frames[2])

            # A frame the receiver cannot check fails the lookup with the reason; the receiver goes on.
            good = Embeddings.decode(fake.frames[3], VALUES, [4], BATCH)
            past = np.full_like(good.bags.values, 1000)  # past the feature's 1000 rows
            fake.frames[7] = Embeddings(KeyedBags(past, good.bags.lengths), good.counts, good.rows).encode(VALUES)
            with pytest.raises(RuntimeError, match="position 1000 outside its 1000 rows"):
                await link.lookup(7, BATCH)
            with pytest.raises(RuntimeError, match="does not describe 1 features of a batch of 64"):
                await link.lookup(3, 64)
            _assert_same(await link.lookup(3, BATCH), fake.frames[3])

            tensors = Gradients(9, {4: np.arange(40, dtype=np.float32).reshape(10, 4)}).packed(ValueCodec())
            applied = await link.push(9, tensors)
            assert applied.applied == 7 and applied.lives == ((0, 3), (1, (1 << 64) - 5))
            assert fake.pushed[9] == Gradients.encode_packed(9, tensors)
            # The trainer's step writes the frame into a slot of the link's (`outgoing`) for the push to send.
            slot = link.outgoing()
            nbytes = Gradients.encode_packed_into(slot.writable, 10, tensors)
            assert (await link.push(10, {}, slot, nbytes)).applied == 7
            assert fake.pushed[10] == Gradients.encode_packed(10, tensors) and slot in link.free

            with pytest.raises(BatchLost, match="batch 404 is not held"):
                await link.lookup(404, BATCH)
            assert link.replaced == 0 and len(link.free) == len(link.slots) - 4  # the lookups of refs 4 and 3 held
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
            pending = asyncio.ensure_future(link.lookup(5, BATCH))
            while fake.asked.get(5, 0) < 1:  # the first receiver is inside the call
                await asyncio.sleep(0.01)
            first = link.process.pid
            os.kill(first, signal.SIGKILL)
            while fake.asked.get(5, 0) < 2:  # its replacement asked again
                await asyncio.sleep(0.01)
            fake.held[5].set()
            looked = await asyncio.wait_for(pending, 30)
            _assert_same(looked, fake.frames[5])
            assert link.replaced == 1 and link.process.pid != first
            _assert_same(await link.lookup(6, BATCH), fake.frames[6])

            # A cancelled lookup's slot comes back once the receiver has answered, not before.
            fake.held = {6: asyncio.Event()}
            asked = fake.asked[6]
            cancelled = asyncio.ensure_future(link.lookup(6, BATCH))
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


class FakeNNWorker:
    """The NN worker's handlers as the trainer serves them through its receiver. A dense batch is admitted at
    once (`admit_now`) and answered with its seq; batches of seq `HOLD` wait (`admit`) until the test lets them
    go; seq `LATE` is refused as out of order; an end of phase is admitted and answered with its end_seq.
    Received echoes the request's length, and refuses one starting with b"joining"."""

    HOLD, LATE = 99, 13

    def __init__(self):
        self.requests: list[bytes] = []
        self.admitted: list[DenseBatch] = []
        self.ends: list[EndOfPhase] = []
        self.release = asyncio.Event()

    def admit_now(self, item: DenseBatch | EndOfPhase) -> Consumed | None:
        if isinstance(item, EndOfPhase):
            self.ends.append(item)
            return Consumed(item.phase, item.end_seq, incarnation=7)
        if item.seq == self.LATE:
            raise rpc.FailedPrecondition(f"batch {item.seq} is out of order")
        if item.seq == self.HOLD:
            return None
        self.admitted.append(item)
        return Consumed(item.phase, item.seq, incarnation=7)

    async def admit(self, item: DenseBatch) -> Consumed:
        self.admitted.append(item)
        await self.release.wait()
        return Consumed(item.phase, item.seq, incarnation=7)

    async def PutBatch(self, request, context):
        raise AssertionError("a data loader's frame reaches the trainer as a BATCH message, not as a call")

    async def Received(self, request, context):
        self.requests.append(bytes(request))
        if request.startswith(b"joining"):
            raise rpc.Unavailable("the NN worker is still joining its group")
        return len(request).to_bytes(8, "little")

    async def Status(self, request, context):
        return pb.TrainingStatus(phase="train", step=42)

    async def Stats(self, request, context):
        return pb.ServiceStats(service="nn_worker", replica=0, values={"x": 1.0})


def _dense_batch(seq: int, rows: int, *, tasks: int = 1, phase: str = "train") -> DenseBatch:
    rng = np.random.default_rng(seq)
    labels = rng.random((rows, tasks) if tasks > 1 else rows, dtype=np.float32)
    return DenseBatch(batch_ref=(1 << 63) + seq, dense=rng.standard_normal((rows, 3), dtype=np.float32),
                      labels=labels, phase=phase, seq=seq, position=(2, 1, (1 << 40) + seq, seq) if seq % 2 else (),
                      rows_before=seq * rows, loader=0)


def _assert_same_batch(got: DenseBatch, sent: DenseBatch) -> None:
    assert (got.batch_ref, got.phase, got.seq, tuple(got.position), got.rows_before, got.loader) == (
        sent.batch_ref, sent.phase, sent.seq, tuple(sent.position), sent.rows_before, sent.loader)
    np.testing.assert_array_equal(got.dense, sent.dense)
    np.testing.assert_array_equal(got.labels, sent.labels)
    assert got.labels.shape == sent.labels.shape and got.dense.flags.writeable


def test_the_nn_workers_server_in_the_receiver_forwards_every_call(worker_and_config):
    """The receiver serves the NN worker's address: dense batches small and large and an end of phase reach the
    trainer decoded and whole, other requests small and large reach its handlers as sent, a malformed frame is
    refused (INVALID_ARGUMENT) and a refused call keeps its status and message and the server goes on, health is the trainer's
    to set, and a killed receiver is replaced, serving again with the health it had."""
    async def scenario():
        server, _, config = await worker_and_config()
        port = _free_port()
        config = config.model_copy(update={"cluster": config.cluster.model_copy(
            update={"nn_workers": [f"127.0.0.1:{port}"]})})
        link = ReceiverLink(config, 0)
        fake = FakeNNWorker()
        link.add_service("NNWorker", fake)
        try:
            assert await link.start_serving() == port
            address = f"127.0.0.1:{port}"
            assert not await rpc.is_serving(address)
            await link.set_serving(True)  # a message the receiver acts on in its own time
            await rpc.wait_until_serving([address], timeout_s=10)
            async with rpc.channel(address) as channel:
                put = rpc.raw_method(channel, "NNWorker", "PutBatch")
                batches = [_dense_batch(1, 2), _dense_batch(2, 65535), _dense_batch(3, 4096),
                           _dense_batch(4, 300, phase="eval")]
                replies = await asyncio.gather(*(put(b.encode()) for b in batches))
                assert [Consumed.decode(r) for r in replies] == [
                    Consumed(b.phase, b.seq, incarnation=7) for b in batches]
                for got, sent in zip(sorted(fake.admitted, key=lambda b: b.seq), batches):
                    _assert_same_batch(got, sent)
                end = EndOfPhase("train", {"rows": 5}, end_seq=9, loader=0)
                assert Consumed.decode(await put(end.encode())) == Consumed("train", 9, incarnation=7)
                assert fake.ends == [end]

                received = rpc.raw_method(channel, "NNWorker", "Received")
                big = np.random.default_rng(0).integers(0, 255, 3_000_000, dtype=np.uint8).tobytes()
                replies = await asyncio.gather(received(b"small"), received(big), received(big[:200_000]))
                assert [int.from_bytes(r, "little") for r in replies] == [5, len(big), 200_000]
                assert sorted(fake.requests, key=len) == [b"small", big[:200_000], big]

                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await put(b"bad frame, not ours")
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a hybridrec frame" in refused.value.details()
                observed = _put_batches_observed()
                assert observed >= len(batches)  # each admitted batch's time, as rpc.guard observes a call
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await put(_dense_batch(FakeNNWorker.LATE, 8).encode())
                assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "out of order" in late.value.details()
                assert _put_batches_observed() == observed + 1  # a refused one too
                with pytest.raises(grpc.aio.AioRpcError) as joining:
                    await received(b"joining")
                assert joining.value.code() == grpc.StatusCode.UNAVAILABLE
                status = await rpc.control_method(channel, "NNWorker", "Status")(pb.Empty())
                assert (status.phase, status.step) == ("train", 42)

                # A batch that waits for room is answered once admitted.
                held = _dense_batch(FakeNNWorker.HOLD, 64)
                waiting = asyncio.ensure_future(put(held.encode()))
                while len(fake.admitted) < len(batches) + 1:
                    await asyncio.sleep(0.01)
                assert not waiting.done()
                fake.release.set()
                assert Consumed.decode(await waiting) == Consumed("train", held.seq, incarnation=7)
                _assert_same_batch(fake.admitted[-1], held)

                # A call held in the trainer when the receiver dies fails for its caller (who sends it again,
                # as to any restarted service); the replacement serves the address, ready as before.
                fake.release.clear()
                cut = asyncio.ensure_future(put(held.encode()))
                while len(fake.admitted) < len(batches) + 2:
                    await asyncio.sleep(0.01)
                os.kill(link.process.pid, signal.SIGKILL)
                with pytest.raises(grpc.aio.AioRpcError):
                    await cut
                fake.release.set()
            await rpc.wait_until_serving([address], timeout_s=30, what="the replacement receiver")
            async with rpc.channel(address) as channel:
                again = _dense_batch(5, 4096)
                reply = await rpc.raw_method(channel, "NNWorker", "PutBatch")(again.encode())
                assert Consumed.decode(reply) == Consumed("train", 5, incarnation=7)
                _assert_same_batch(fake.admitted[-1], again)
            assert link.replaced == 1
        finally:
            await link.close()
            await server.stop(None)
    asyncio.run(scenario())


def test_both_putbatch_entries_share_one_admit_path(worker_and_config, monkeypatch):
    """The NN worker's own server and its receiver decode and admit a data loader's frame through one function
    (`admission.admit_frame`): every frame passes it once through each entry, and each entry answers it alike —
    malformed frames refused with the same status and message, batches and duplicates answered alike."""
    async def scenario():
        server, _, config = await worker_and_config()
        port = _free_port()
        config = config.model_copy(update={"cluster": config.cluster.model_copy(
            update={"nn_workers": [f"127.0.0.1:{port}"]})})
        passed: list[bytes] = []
        shared = admission.admit_frame

        def counted(frame, *args, **kwargs):
            passed.append(bytes(frame))
            return shared(frame, *args, **kwargs)
        monkeypatch.setattr(admission, "admit_frame", counted)

        def servicer() -> NNWorkerServicer:
            ledger = Ledger(0, 1, 1)
            ledger.resume_at([0])
            ledger.open()
            return NNWorkerServicer(config, 0, Inbox(1, maxsize=4), ledger)
        direct, behind = servicer(), servicer()
        own = rpc.new_server()
        rpc.add_service(own, "NNWorker", direct)
        own_port = rpc.bind(own, "127.0.0.1", 0)
        await own.start()
        receiver = ReceiverLink(config, 0)
        receiver.add_service("NNWorker", behind)
        frames = [b"bad frame, not ours", _dense_batch(0, 8).encode(), _dense_batch(0, 8).encode(),
                  _dense_batch(5, 8).encode(), _dense_batch(1, 8, phase="eval").encode(),
                  DenseBatch(batch_ref=1, dense=np.zeros((2, 3), np.float32), labels=np.zeros(2, np.float32),
                             seq=1, loader=3).encode(),
                  EndOfPhase("eval", {}, end_seq=1, loader=0).encode()]
        try:
            await receiver.start_serving()
            await receiver.set_serving(True)
            await rpc.wait_until_serving([f"127.0.0.1:{port}"], timeout_s=10)
            answers = []
            for address in (f"127.0.0.1:{own_port}", f"127.0.0.1:{port}"):
                async with rpc.channel(address) as channel:
                    put = rpc.raw_method(channel, "NNWorker", "PutBatch")
                    got = []
                    for frame in frames:
                        try:
                            consumed = Consumed.decode(await put(frame))
                            got.append((consumed.phase, consumed.through))
                        except grpc.aio.AioRpcError as refused:
                            got.append((refused.code(), refused.details()))
                    answers.append(got)
        finally:
            await receiver.close()
            await own.stop(None)
            await server.stop(None)
        assert passed == frames + frames
        assert answers[0] == answers[1], answers
        codes = [answer[0] for answer in answers[0]]
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT, "train", "train", grpc.StatusCode.FAILED_PRECONDITION,
                         "train", grpc.StatusCode.INVALID_ARGUMENT, "train"], answers[0]
        assert direct.duplicates == behind.duplicates == 1  # batch 0 sent twice: the second dropped alike
        assert direct.inbox.qsize() == behind.inbox.qsize() == 3  # batch 0, the eval batch, the end of eval
    asyncio.run(scenario())


def _put_batches_observed() -> float:
    """PutBatch calls in this (the trainer's) process's RPC latency histogram."""
    return REGISTRY.get_sample_value("hybridrec_rpc_latency_seconds_count",
                                     {"service": "NNWorker", "method": "PutBatch"}) or 0.0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_full_link_queues_messages_in_order_and_never_blocks():
    """A few hundred messages fill a SOCK_SEQPACKET socket's buffer: the rest wait in the writer's queue, in
    order, and go out as the peer reads; the sender never blocks, never raises."""
    async def scenario():
        ours, theirs = link.socket_pair()
        ours.setblocking(False)
        theirs.setblocking(False)
        writer, reader = link.LinkWriter(ours), link.LinkReader(theirs)
        for call in range(5000):
            writer.send(link.Message(link.DONE, call, payload=b"x" * (call % 50)))
        assert writer.queue  # the buffer filled
        got = []
        while len(got) < 5000:
            await asyncio.sleep(0)  # the writer's callback sends more once the socket is writable
            while True:
                try:
                    message, _ = reader.receive()
                except BlockingIOError:
                    break
                assert message.payload == b"x" * (message.call % 50)
                got.append(message.call)
        assert got == list(range(5000)) and not writer.queue
        theirs.close()
        writer.send(link.Message(link.DONE, 1))  # to a peer that is gone: dropped
        ours.close()
    asyncio.run(scenario())
