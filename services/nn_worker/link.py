"""Between an NN worker's trainer and its receiver process: shared-memory slots and the messages that hand
them over.

The receiver (`services/nn_worker/receiver.py`, `training.receiver`) makes the trainer's calls to the
embedding workers — the `Lookup` whose reply is the batch's megabyte-sized `Embeddings` frame and the
`PushGradients` that carries its gradients — so that gRPC's work for them (its Python layer, its copies)
runs in another process and does not hold the trainer's GIL. Frames travel in slots: anonymous
shared-memory files (memfd) that both processes map. Control travels as small messages over a Unix
`SOCK_SEQPACKET` socket pair, one per call and one per answer (`HEADER`, and a short payload).

**One owner per slot.** The trainer owns every free slot. A lookup hands one to the receiver, which
writes the reply frame into it and hands it back with the frame's length; the trainer decodes views of it
and frees it once the step has used the batch. A push is the gradient frame written by the trainer into a
free slot and handed to the receiver until the embedding worker's answer. Nobody reads a slot its owner
may be writing, so no slot is read half-written: a receiver that dies mid-write never hands its slot
back, and its replacement (`ReceiverLink` starts one and sends it every call still unanswered: lookups
and pushes are both safe to repeat, see routing.py) writes the frame again.

A slot grows (`ftruncate`) when a frame does not fit; the other side maps it again when it is told of a
frame longer than its mapping.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import mmap
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import grpc

from hybridrec import log, rpc
from hybridrec.frames import Applied, DenseBatch, EndOfPhase, Gradients, decode_nn_batch
from hybridrec.slot_layouts import BatchSlot
from hybridrec.metrics import RPC_LATENCY
from hybridrec.proto import pb
from hybridrec.rpc import Unavailable
from services.nn_worker.routing import BatchLost, Looked

INITIAL_SLOT_BYTES = 4 << 20
"""A slot's first size: an `Embeddings` frame of the README example at batch 4096 is about 1.5 MB."""
GROWTH_BYTES = 1 << 20
"""A slot grows to the frame's size rounded up to this."""
INITIAL_INBOUND_BYTES = 1 << 20
"""A receiver's slot for a request to the NN worker: a `DenseBatch` of the README example is 230 kB."""

HEADER = struct.Struct("<B3xIQIQ")
"""op, call id, batch_ref, slot, frame bytes; a message's payload (an answer's frame, an error) follows."""
MAX_MESSAGE_BYTES = 1 << 16
"""Largest message (header and payload): answers carry small frames (`Applied`, `Consumed`, `Received`, the
Status and Stats messages) and error lines; a larger request travels in a slot."""

# To the receiver
SLOT = 1  # a new slot; its file descriptor rides along (SCM_RIGHTS)
LOOKUP = 2  # look up batch_ref, check its frame for a batch of `nbytes` samples, lay it out into the slot
PUSH = 3  # the slot holds a Gradients frame of that many bytes for batch_ref
SERVE = 4  # start the NN worker's gRPC server (answered by LISTENING)
REPLY = 5  # the answer to a CALLED: its bytes follow
REFUSE = 6  # a CALLED refused: `ref` is the gRPC status code, the detail follows
HEALTH = 7  # the NN worker is ready (nbytes 1) or not (0)
# To the trainer
DONE = 10  # the call succeeded: a lookup's frame is in its slot (its length in `nbytes`); a push's answer follows
LOST = 11  # NOT_FOUND: the embedding worker no longer holds the batch (routing.BatchLost)
UNAVAILABLE = 12  # the call failed for `cluster.retry_s` (rpc.Unavailable)
FAILED = 13  # anything else (a bad batch_ref): the message follows
CALLED = 14  # a call to the NN worker's server: `ref` is the method (NN_METHODS), the request in the payload
             # or in the receiver's inbound slot `slot`
INBOUND_SLOT = 15  # a new slot of the receiver's, for requests; its file descriptor rides along
LISTENING = 16  # the server is serving on port `nbytes` (or FAILED: it could not bind)
BATCH = 17  # a data loader's PutBatch, decoded and checked by the receiver: a dense batch laid out
            # (`ref` LAID_OUT: `slot_layouts.BatchSlot`'s fields in the payload, its arrays in the receiver's
            # inbound slot `slot`), or an end of phase's frame as it came (`ref` FRAME, in the payload or slot);
            # answered by REPLY with the `Consumed` frame, or REFUSE
LAID_OUT, FRAME = 0, 1  # a BATCH message's `ref`

NO_SLOT = 0xFFFFFFFF
"""`slot` of a message whose bytes ride in its payload."""
INLINE_BYTES = MAX_MESSAGE_BYTES - HEADER.size
"""A request or an answer up to this size rides in its message."""


class Message(NamedTuple):
    op: int
    call: int = 0
    ref: int = 0
    slot: int = 0
    nbytes: int = 0
    payload: bytes = b""

    def pack(self) -> bytes:
        return HEADER.pack(self.op, self.call, self.ref, self.slot, self.nbytes) + self.payload



APPLIED = struct.Struct("<QI")
"""A push's answer as the receiver passes it on: rows applied, then how many (shard, life) pairs follow
(`LIFE`): the `Applied` frame decoded (and checked) in the receiver, not on the trainer's event loop."""
LIFE = struct.Struct("<QQ")


def pack_applied(applied: Applied) -> bytes:
    return APPLIED.pack(applied.applied, len(applied.lives)) + b"".join(LIFE.pack(*pair) for pair in applied.lives)


def unpack_applied(data: bytes) -> Applied:
    rows, count = APPLIED.unpack_from(data)
    return Applied(rows, tuple(LIFE.unpack_from(data, APPLIED.size + i * LIFE.size) for i in range(count)))


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """The link's two ends: message boundaries kept, both ends non-inheritable until passed on purpose."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


_FDS_SIZE = socket.CMSG_LEN(struct.calcsize("i"))


class LinkReader:
    """Reads one end of the link into one buffer kept for it (a fresh 64 kB buffer per message cost the
    trainer's event loop more than the message)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = bytearray(MAX_MESSAGE_BYTES)
        self.view = memoryview(self.buffer)

    def receive(self) -> tuple[Message | None, list[int]]:
        """One message and any file descriptors it carried (a slot's); (None, []) at the end of the link (the
        peer is gone). Raises BlockingIOError on a non-blocking socket with nothing to read."""
        size, ancillary, _flags, _addr = self.sock.recvmsg_into([self.buffer], _FDS_SIZE)
        fds = []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) - len(payload) % 4]))
        if not size:
            return None, fds
        if size < HEADER.size:
            raise ValueError(f"a link message of {size} bytes is shorter than its header ({HEADER.size})")
        return Message(*HEADER.unpack_from(self.buffer), bytes(self.view[HEADER.size:size])), fds

    def drain(self, on_message: Callable[[Message, list[int]], None], on_end: Callable[[], None]) -> None:
        """The event loop's reader callback: the next message to `on_message`; `on_end` once the peer is gone.
        One message a call: the loop calls again while more wait (its readers are level-triggered), which
        costs less than the exception a read of an empty socket raises (most calls find one message)."""
        try:
            message, fds = self.receive()
        except BlockingIOError:
            return
        except ConnectionError:
            message, fds = None, []
        if message is None:
            on_end()
            return
        on_message(message, fds)


class LinkWriter:
    """Sends on one end of the link without ever blocking its event loop: a message that finds the socket's
    buffer full (a few hundred messages fill it) waits in order in a queue, sent when the socket is writable.
    A message to a peer that is gone is dropped: the reader sees the link end, and the trainer sends what is
    unanswered to the next receiver."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.queue: collections.deque[tuple[bytes, int | None]] = collections.deque()

    def send(self, message: Message, fd: int | None = None) -> None:
        data = message.pack()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"link message of {len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
        if not self.queue and self._sent(data, fd):
            return
        self.queue.append((data, fd))
        if len(self.queue) == 1:
            asyncio.get_running_loop().add_writer(self.sock.fileno(), self._flush)

    def _sent(self, data: bytes, fd: int | None) -> bool:
        """False when the socket's buffer is full; True once sent, or dropped because the peer is gone."""
        try:
            if fd is None:
                self.sock.send(data)
            else:
                socket.send_fds(self.sock, [data], [fd])
        except BlockingIOError:
            return False
        except OSError:
            pass  # the peer is gone (the reader sees the end of the link), or the link was closed here
        return True

    def _flush(self) -> None:
        while self.queue:
            data, fd = self.queue[0]
            if not self._sent(data, fd):
                return
            self.queue.popleft()
        self.close()

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_writer(self.sock.fileno())


class Slot:
    """One shared-memory file, mapped by this process; `view` maps it again when it has grown."""

    __slots__ = ("index", "fd", "_map", "_mapped")

    def __init__(self, index: int, fd: int):
        self.index, self.fd = index, fd
        self._map: mmap.mmap | None = None
        self._mapped = 0

    @classmethod
    def create(cls, index: int, nbytes: int = INITIAL_SLOT_BYTES) -> "Slot":
        fd = os.memfd_create(f"hybridrec-slot-{index}", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        return cls(index, fd)

    def view(self, nbytes: int) -> memoryview:
        """The slot's first `nbytes` (writable)."""
        if nbytes > self._mapped:
            size = os.fstat(self.fd).st_size
            if nbytes > size:
                raise ValueError(f"slot {self.index} holds {size} bytes, not the {nbytes} of its frame")
            # The old mapping stays alive while views of it do (a batch still being used), then goes.
            self._map, self._mapped = mmap.mmap(self.fd, size), size
        return memoryview(self._map)[:nbytes]

    def writable(self, nbytes: int) -> memoryview:
        """The slot's first `nbytes`, grown first if the frame does not fit (the writer's side)."""
        if nbytes > os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, -(-nbytes // GROWTH_BYTES) * GROWTH_BYTES)
        return self.view(nbytes)

    def close(self) -> None:
        self._map = None
        os.close(self.fd)


LINK_FD_ENV = "HYBRIDREC_LINK_FD"
"""The receiver's end of the socket pair (an inherited file descriptor)."""
CONFIG_FD_ENV = "HYBRIDREC_LINK_CONFIG_FD"
"""A memfd holding the job's config as JSON, for the receiver."""
RESTARTS_ALLOWED = 3
"""Receivers that may die within `RESTART_WINDOW_S` of each other before the trainer gives up (a receiver
that cannot start at all would otherwise be restarted for ever)."""
RESTART_WINDOW_S = 10.0


class _Refused(Exception):
    """A forwarded call's handler refused it (`rpc.guard` aborts through `_ForwardedContext`)."""

    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class _ForwardedContext:
    """What `rpc.guard` and the NN worker's handlers use of a gRPC context, for a call the receiver forwarded."""

    async def abort(self, code: grpc.StatusCode, detail: str) -> None:
        raise _Refused(code, detail)


def nn_methods() -> list:
    """The NNWorker service's methods, in the order their index travels in a `CALLED` message."""
    return list(pb.DESCRIPTOR.services_by_name["NNWorker"].methods)


class ReceiverLink:
    """The trainer's side of the link: starts the receiver, hands it the step's calls, serves the calls it
    forwards, replaces it when it dies. `lookup` and `push` are those of `routing.EmbeddingWorkers`;
    `add_service`, `start_serving`, `set_serving` are what `ServiceHost` asks of a server elsewhere."""

    def __init__(self, config, replica: int):
        self.config, self.replica = config, replica
        self.slots: list[Slot] = []
        self.free: list[Slot] = []
        self.inbound: dict[int, Slot] = {}  # the receiver's slots, for requests forwarded to this process
        self.pending: dict[int, tuple[Message, asyncio.Future, Slot | None, Callable]] = {}
        self.handlers: list = [None] * len(nn_methods())  # (guarded handler, serialize) per method
        self.admit = self.admit_now = None  # the NN worker's, for the receiver's BATCH messages
        self.loaders = len(config.cluster.dataloader)
        self.batch_latency = None  # their handling's time, as rpc.guard observes a call's
        self.service_name = ""
        self.port: int | None = None  # once serving
        self.serving = False
        self.replaced = 0
        self._calls = itertools.count(1)
        self._deaths: list[float] = []
        self._broken: str | None = None
        self._answering: set[asyncio.Task] = set()
        self.sock: socket.socket | None = None
        self.process: subprocess.Popen | None = None
        self._spawn()

    # -- the trainer's calls -------------------------------------------------------------------------
    def lookup(self, ref: int, batch_size: int) -> asyncio.Future:
        """The batch's embeddings as the receiver checked them for a batch of `batch_size` samples (a
        `CheckedEmbeddings` layout), in a slot given back by the result's `release`: a future (a `Looked`), not a
        coroutine, so that a lookup costs the trainer's event loop no task."""
        slot = self._slot()
        return self._start(LOOKUP, ref, slot, batch_size,
                           lambda answer: Looked(slot.view(answer.nbytes), lambda: self.free.append(slot), checked=True))

    def push(self, ref: int, tensors: dict, into: Slot | None = None, nbytes: int | None = None) -> asyncio.Future:
        """Send the batch's packed gradients; a future of the `Applied` answer (routing.EmbeddingWorkers.push).
        `into`: a slot from `outgoing`, which holds the frame already when `nbytes` is given (the trainer's
        compute thread wrote it)."""
        slot = into if into is not None else self._slot()
        if nbytes is None:
            try:
                nbytes = Gradients.encode_packed_into(slot.writable, ref, tensors)
            except BaseException:
                self.free.append(slot)
                raise

        def applied(answer: Message) -> Applied:
            self.free.append(slot)
            return unpack_applied(answer.payload)
        return self._start(PUSH, ref, slot, nbytes, applied)

    def outgoing(self) -> Slot:
        """A free slot for the gradient frame of the step about to run, which the step writes on the compute
        thread (`StepMath.train`) so that the 0.6 MB copy does not run on the event loop; `push` sends it
        and frees it."""
        return self._slot()

    def _slot(self) -> Slot:
        if self.free:
            return self.free.pop()
        slot = Slot.create(len(self.slots))
        self.slots.append(slot)
        self.writer.send(Message(SLOT, slot=slot.index), slot.fd)
        return slot

    def _start(self, op: int, ref: int, slot: Slot | None, nbytes: int = 0,
               done: Callable[[Message], object] = lambda answer: answer) -> asyncio.Future:
        """Hand `slot` to the receiver for one call; a future of `done(answer)` once it answers. The slot is the
        caller's again once the call succeeds (`done` may free it); on an error it is given back here; if the
        future is cancelled, when the receiver answers (it may still be writing into it)."""
        future = asyncio.get_running_loop().create_future()
        if self._broken is not None:
            if slot is not None:
                self.free.append(slot)
            future.set_exception(Unavailable(self._broken))
            return future
        message = Message(op, next(self._calls) & 0xFFFFFFFF, ref, NO_SLOT if slot is None else slot.index, nbytes)
        self.pending[message.call] = (message, future, slot, done)
        self.writer.send(message)
        return future

    def _answered(self, message: Message) -> None:
        """The receiver's answer to one of the trainer's calls: its future resolved."""
        entry = self.pending.pop(message.call, None)
        if entry is None:
            return
        sent, future, slot, done = entry
        if future.cancelled():
            if slot is not None:
                self.free.append(slot)  # its caller is gone; the receiver is done with it
            return
        if message.op in (DONE, LISTENING):
            try:
                future.set_result(done(message))
                return
            except Exception as exc:  # noqa: BLE001 - the caller's to raise (a frame larger than its slot)
                error: Exception = exc
        else:
            text = message.payload.decode(errors="replace")
            error = (BatchLost(text) if message.op == LOST else Unavailable(text) if message.op == UNAVAILABLE
                     else RuntimeError(f"the NN worker's receiver failed a call (batch_ref {sent.ref}): {text}"))
        if slot is not None:
            self.free.append(slot)
        future.set_exception(error)

    # -- the NN worker's server, in the receiver -------------------------------------------------------
    def add_service(self, proto_service: str, impl) -> None:
        """Serve `impl`'s NNWorker methods for the calls the receiver forwards, each through `rpc.guard`, and
        its `admit_now` and `admit` for the data loaders' frames (`BATCH`)."""
        self.service_name, self.admit, self.admit_now = proto_service, impl.admit, impl.admit_now
        self.batch_latency = RPC_LATENCY.labels(proto_service, "PutBatch")
        for index, method in enumerate(nn_methods()):
            fn = getattr(impl, method.name)
            if method.input_type is rpc.FRAME:
                self.handlers[index] = (rpc.guard(fn, proto_service, method.name), None)
            else:
                parse = getattr(pb, method.input_type.name).FromString
                self.handlers[index] = (rpc.guard(_parsed(fn, parse), proto_service, method.name),
                                        lambda reply: reply.SerializeToString())

    async def start_serving(self) -> int:
        """Have the receiver serve the NN worker's address; the port it bound."""
        answer = await self._start(SERVE, 0, None)
        self.port = answer.nbytes
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """The health service's overall status, in the receiver."""
        self.serving = serving
        if self.sock is not None and self.sock.fileno() >= 0:
            self.writer.send(Message(HEALTH, nbytes=int(serving)))

    def _called(self, message: Message) -> None:
        """A call to the NN worker: read its request now (the receiver frees its slot when answered)."""
        if message.slot == NO_SLOT:
            request = message.payload
        else:
            request = bytes(self.inbound[message.slot].view(message.nbytes))
        task = asyncio.ensure_future(self._answer(self.writer, message.call, message.ref, request))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    def _batch(self, message: Message) -> None:
        """A data loader's PutBatch, decoded and checked by the receiver: admitted here and answered at once where
        that need not wait (the common case: no task), else by a task that waits for room in the inbox."""
        started = time.perf_counter()
        try:
            if self.admit_now is None:
                raise Unavailable("the NN worker is starting")
            item = self._item(message)
            consumed = self.admit_now(item)
        except Exception as exc:  # noqa: BLE001 - answered as rpc.guard answers it; the link goes on
            self._answer_batch(self.writer, self._refusal(message.call, exc), started)
            return
        if consumed is not None:
            self._answer_batch(self.writer, Message(REPLY, message.call, payload=consumed.encode()), started)
            return
        task = asyncio.ensure_future(self._admit(self.writer, message.call, item, started))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    def _item(self, message: Message) -> DenseBatch | EndOfPhase:
        """What a `BATCH` message carries: a dense batch copied out of the receiver's slot, or an end of phase
        read from its frame (an end is rare: two per loader and job)."""
        if message.ref == LAID_OUT:
            return BatchSlot.read(message.payload, self.inbound[message.slot].view(message.nbytes))
        config = self.config
        frame = message.payload if message.slot == NO_SLOT else bytes(self.inbound[message.slot].view(message.nbytes))
        return decode_nn_batch(frame, config.num_dense, config.num_tasks, self.loaders)

    async def _admit(self, writer: LinkWriter, call: int, item: DenseBatch | EndOfPhase, started: float) -> None:
        try:
            answer = Message(REPLY, call, payload=(await self.admit(item)).encode())
        except Exception as exc:  # noqa: BLE001 - as in _batch
            answer = self._refusal(call, exc)
        self._answer_batch(writer, answer, started)

    def _answer_batch(self, writer: LinkWriter, answer: Message, started: float) -> None:
        """Send a batch's answer (not to a receiver replaced since: as in `_answer`) and observe its time, as
        rpc.guard observes every call, refused or not."""
        if writer is self.writer:
            writer.send(answer)
        if self.batch_latency is not None:  # None until the NN worker's handlers are added
            self.batch_latency.observe(time.perf_counter() - started)

    def _refusal(self, call: int, exc: Exception) -> Message:
        code, detail = rpc.status_of(exc, self.service_name, "PutBatch")
        return Message(REFUSE, call, code.value[0], payload=detail.encode()[:INLINE_BYTES])

    async def _answer(self, writer: LinkWriter, call: int, index: int, request: bytes) -> None:
        try:
            if self.handlers[index] is None:
                raise _Refused(grpc.StatusCode.UNAVAILABLE, "the NN worker is starting")
            handler, serialize = self.handlers[index]
            reply = await handler(request, _ForwardedContext())
            data = serialize(reply) if serialize is not None else reply
            if len(data) > INLINE_BYTES:
                raise _Refused(grpc.StatusCode.INTERNAL, f"an answer of {len(data)} bytes does not fit the link")
            answer = Message(REPLY, call, payload=data)
        except _Refused as refused:
            answer = Message(REFUSE, call, refused.code.value[0], payload=refused.detail.encode()[:INLINE_BYTES])
        if writer is self.writer:  # not a call of a receiver that has been replaced since (its caller sends
            writer.send(answer)    # the call again to the next one)

    # -- the answers -----------------------------------------------------------------------------
    def _on_readable(self) -> None:
        self.reader.drain(self._on_message, self._lost)

    def _on_message(self, message: Message, fds: list[int]) -> None:
        if message.op == BATCH:
            self._batch(message)
            return
        if message.op == CALLED:
            self._called(message)
            return
        if message.op == INBOUND_SLOT:
            self.inbound[message.slot] = Slot(message.slot, fds[0])
            return
        self._answered(message)

    # -- the receiver process ------------------------------------------------------------------
    def _spawn(self) -> None:
        ours, theirs = socket_pair()
        config_fd = os.memfd_create("hybridrec-receiver-config", 0)
        try:
            os.write(config_fd, self.config.model_dump_json().encode())
            os.lseek(config_fd, 0, os.SEEK_SET)
            root = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, LINK_FD_ENV: str(theirs.fileno()), CONFIG_FD_ENV: str(config_fd),
                   "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.nn_worker.receiver", str(self.replica)],
                pass_fds=(theirs.fileno(), config_fd), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            os.close(config_fd)
        ours.setblocking(False)
        self.sock, self.reader, self.writer = ours, LinkReader(ours), LinkWriter(ours)
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_readable)
        for slot in self.slots:
            self.writer.send(Message(SLOT, slot=slot.index), slot.fd)

    def _lost(self) -> None:
        """The receiver is gone (killed, or it failed): start another and send it every unanswered call;
        serve again if it served."""
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.writer.close()
        self.sock.close()
        self.process.kill()
        code = self.process.wait()
        for slot in self.inbound.values():
            slot.close()
        self.inbound.clear()
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        logger = log.get()
        if len(self._deaths) > RESTARTS_ALLOWED:
            self._broken = (f"the NN worker's receiver process died {len(self._deaths)} times within "
                            f"{RESTART_WINDOW_S:.0f} s (last exit status {code})")
            logger.error("receiver_failed", exit_code=code, deaths=len(self._deaths))
            for _, future, slot, _ in self.pending.values():
                if slot is not None:
                    self.free.append(slot)
                if not future.cancelled():
                    future.set_exception(Unavailable(self._broken))
            self.pending.clear()
            return
        logger.warning("receiver_lost", exit_code=code, unanswered=len(self.pending))
        self.replaced += 1
        for call, (_, future, slot, _) in list(self.pending.items()):
            if future.cancelled():
                del self.pending[call]
                if slot is not None:
                    self.free.append(slot)
        self._spawn()
        for message, _, _, _ in self.pending.values():
            self.writer.send(message)
        if self.port is not None and not any(m.op == SERVE for m, _, _, _ in self.pending.values()):
            task = asyncio.ensure_future(self._serve_again())
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _serve_again(self) -> None:
        """A replacement receiver serves the NN worker's address again, with the health it had."""
        try:
            await self._start(SERVE, 0, None)
            await self.set_serving(self.serving)
        except Exception as exc:  # noqa: BLE001 - the next failure of a call says it again
            log.get().error("receiver_not_serving", error=str(exc))

    async def close(self) -> None:
        """End the link: the receiver sees its end close, stops its server and exits."""
        if self.sock is not None and self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.writer.close()
            self.sock.close()
        for task in list(self._answering):
            task.cancel()
        if self.process is not None:
            try:
                await asyncio.to_thread(self.process.wait, 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for slot in [*self.slots, *self.inbound.values()]:
            slot.close()


def _parsed(fn, parse):
    """A protobuf method's handler, given the request's bytes."""
    async def handler(request: bytes, context):
        return await fn(parse(request), context)
    return handler
