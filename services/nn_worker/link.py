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
import itertools
import mmap
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from hybridrec import log
from hybridrec.frames import Applied, Gradients
from hybridrec.rpc import Unavailable
from services.nn_worker.routing import BatchLost, Looked

INITIAL_SLOT_BYTES = 4 << 20
"""A slot's first size: an `Embeddings` frame of the README example at batch 4096 is about 1.5 MB."""
GROWTH_BYTES = 1 << 20
"""A slot grows to the frame's size rounded up to this."""

HEADER = struct.Struct("<B3xIQIQ")
"""op, call id, batch_ref, slot, frame bytes; a message's payload (an answer's frame, an error) follows."""
MAX_MESSAGE_BYTES = 1 << 16
"""Largest message (header and payload): answers carry small frames (`Applied`) and error lines."""

# To the receiver
SLOT = 1  # a new slot; its file descriptor rides along (SCM_RIGHTS)
LOOKUP = 2  # look up batch_ref into the slot
PUSH = 3  # the slot holds a Gradients frame of that many bytes for batch_ref
# To the trainer
DONE = 10  # the call succeeded: a lookup's frame is in its slot (its length in `nbytes`); a push's answer follows
LOST = 11  # NOT_FOUND: the embedding worker no longer holds the batch (routing.BatchLost)
UNAVAILABLE = 12  # the call failed for `cluster.retry_s` (rpc.Unavailable)
FAILED = 13  # anything else (a bad batch_ref): the message follows


class Message(NamedTuple):
    op: int
    call: int = 0
    ref: int = 0
    slot: int = 0
    nbytes: int = 0
    payload: bytes = b""

    def pack(self) -> bytes:
        return HEADER.pack(self.op, self.call, self.ref, self.slot, self.nbytes) + self.payload

    @classmethod
    def unpack(cls, data: bytes) -> "Message":
        if len(data) < HEADER.size:
            raise ValueError(f"a link message of {len(data)} bytes is shorter than its header ({HEADER.size})")
        return cls(*HEADER.unpack_from(data), data[HEADER.size:])


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


def receive(sock: socket.socket) -> Message | None:
    """One message; None at the end of the link (the peer is gone). Raises BlockingIOError on a non-blocking
    socket with nothing to read."""
    data = sock.recv(MAX_MESSAGE_BYTES)
    return Message.unpack(data) if data else None


def receive_with_fds(sock: socket.socket) -> tuple[Message | None, list[int]]:
    """`receive`, and any file descriptors the message carried (the receiver's side: `SLOT`)."""
    fds_size = socket.CMSG_LEN(struct.calcsize("i"))
    data, ancillary, _flags, _addr = sock.recvmsg(MAX_MESSAGE_BYTES, fds_size)
    fds = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) - len(payload) % 4]))
    if not data:
        return None, fds
    return Message.unpack(data), fds


def send(sock: socket.socket, message: Message, fd: int | None = None) -> None:
    data = message.pack()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"link message of {len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
    if fd is None:
        sock.sendall(data)
    else:
        socket.send_fds(sock, [data], [fd])


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


class ReceiverLink:
    """The trainer's side of the link: starts the receiver, hands it the step's calls, replaces it when it
    dies. `lookup` and `push` are those of `routing.EmbeddingWorkers`."""

    def __init__(self, config, replica: int):
        self.config, self.replica = config, replica
        self.slots: list[Slot] = []
        self.free: list[Slot] = []
        self.pending: dict[int, tuple[Message, asyncio.Future, Slot]] = {}
        self.replaced = 0
        self._calls = itertools.count(1)
        self._deaths: list[float] = []
        self._broken: str | None = None
        self.sock: socket.socket | None = None
        self.process: subprocess.Popen | None = None
        self._spawn()

    # -- the calls -----------------------------------------------------------------------------
    async def lookup(self, ref: int):
        """The batch's `Embeddings` frame, in a slot given back by the result's `release`."""
        slot = self._slot()
        answer = await self._call(LOOKUP, ref, slot)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.free.append(slot)
        return Looked(slot.view(answer.nbytes), release)

    async def push(self, ref: int, tensors: dict):
        """Send the batch's packed gradients; the `Applied` answer (routing.EmbeddingWorkers.push)."""
        slot = self._slot()
        try:
            nbytes = Gradients.encode_packed_into(slot.writable, ref, tensors)
        except BaseException:
            self.free.append(slot)
            raise
        answer = await self._call(PUSH, ref, slot, nbytes)
        self.free.append(slot)
        return unpack_applied(answer.payload)

    def _slot(self) -> Slot:
        if self.free:
            return self.free.pop()
        slot = Slot.create(len(self.slots))
        self.slots.append(slot)
        send(self.sock, Message(SLOT, slot=slot.index), slot.fd)
        return slot

    async def _call(self, op: int, ref: int, slot: Slot, nbytes: int = 0) -> Message:
        """Hand `slot` to the receiver for one call and wait for its answer. The slot is the caller's again
        once this returns; on an error it is given back here; if the caller is cancelled, when the receiver
        answers (it may still be writing into it)."""
        if self._broken is not None:
            self.free.append(slot)
            raise Unavailable(self._broken)
        message = Message(op, next(self._calls) & 0xFFFFFFFF, ref, slot.index, nbytes)
        future = asyncio.get_running_loop().create_future()
        self.pending[message.call] = (message, future, slot)
        send(self.sock, message)
        answer = await future
        if answer.op == DONE:
            return answer
        self.free.append(slot)
        text = answer.payload.decode(errors="replace")
        if answer.op == LOST:
            raise BatchLost(text)
        if answer.op == UNAVAILABLE:
            raise Unavailable(text)
        raise RuntimeError(f"the NN worker's receiver failed a call for batch_ref {ref}: {text}")

    # -- the answers ---------------------------------------------------------------------------
    def _on_readable(self) -> None:
        while True:
            try:
                answer = receive(self.sock)
            except BlockingIOError:
                return
            except ConnectionError:
                answer = None
            if answer is None:
                self._lost()
                return
            entry = self.pending.pop(answer.call, None)
            if entry is None:
                continue
            _, future, slot = entry
            if future.cancelled():
                self.free.append(slot)  # its caller is gone; the receiver is done with it
            else:
                future.set_result(answer)

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
        self.sock = ours
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_readable)
        for slot in self.slots:
            send(ours, Message(SLOT, slot=slot.index), slot.fd)

    def _lost(self) -> None:
        """The receiver is gone (killed, or it failed): start another and send it every unanswered call."""
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()
        self.process.kill()
        code = self.process.wait()
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        logger = log.get()
        if len(self._deaths) > RESTARTS_ALLOWED:
            self._broken = (f"the NN worker's receiver process died {len(self._deaths)} times within "
                            f"{RESTART_WINDOW_S:.0f} s (last exit status {code})")
            logger.error("receiver_failed", exit_code=code, deaths=len(self._deaths))
            for _, future, slot in self.pending.values():
                self.free.append(slot)
                if not future.cancelled():
                    future.set_exception(Unavailable(self._broken))
            self.pending.clear()
            return
        logger.warning("receiver_lost", exit_code=code, unanswered=len(self.pending))
        self.replaced += 1
        for call, (_, future, slot) in list(self.pending.items()):
            if future.cancelled():
                del self.pending[call]
                self.free.append(slot)
        self._spawn()
        for message, _, _ in self.pending.values():
            send(self.sock, message)

    async def close(self) -> None:
        """End the link: the receiver sees its end close and exits."""
        if self.sock is not None and self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
        if self.process is not None:
            try:
                await asyncio.to_thread(self.process.wait, 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for slot in self.slots:
            slot.close()
