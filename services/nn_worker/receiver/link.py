"""Between an NN worker's trainer and its receiver process: the link's transport — shared-memory slots and the
messages that hand them over. The trainer's side of it is `ReceiverLink` (receiver_link.py), the receiver's
is process.py; what a slot holds besides frames is hybridrec/core/layouts/slot_layouts.py's.

The receiver (`services/nn_worker/receiver/process.py`, `training.receiver`) makes the trainer's calls to the
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
import mmap
import os
import socket
import struct
from typing import Callable, NamedTuple

from hybridrec.core.wire.frames import Applied
from hybridrec.core.wire.proto import pb

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
BATCH = 17  # a data loader's PutBatch (a dense batch or an end of phase), its frame as it came, in the payload
            # or in the receiver's inbound slot `slot`; answered by REPLY with the `Consumed` frame, or REFUSE

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


def nn_methods() -> list:
    """The NNWorker service's methods, in the order their index travels in a `CALLED` message."""
    return list(pb.DESCRIPTOR.services_by_name["NNWorker"].methods)
