"""The NN worker's receiver: a child process that holds the NN worker's network face.

Started by `ReceiverLink` (receiver_link.py) when `training.receiver` is on, with two inherited file descriptors:
its end of the link's socket pair (`HYBRIDREC_LINK_FD`) and the job's config as JSON
(`HYBRIDREC_LINK_CONFIG_FD`). It runs its own event loop and gRPC channels and server:

* for each `LOOKUP` it calls the batch's embedding worker, checks the `Embeddings` frame (`Pooler.check`)
  and writes it into the slot it was handed with what pooling derives from it (`CheckedEmbeddings`), so
  that the trainer only makes views of it; for each `PUSH` it sends the slot's `Gradients` frame. The calls are
  `EmbeddingWorkers`' own (routing.py): the same routing by batch_ref, retries for `cluster.retry_s`, and
  NOT_FOUND as a lost batch;
* once told to (`SERVE`), it serves the NN worker's address. A data loader's `PutBatch` is handed to the
  trainer as a `BATCH` message, the frame as it came (in one of the receiver's own slots when large): one
  layout serves the wire and the slot, and the trainer decodes it once (a malformed frame is INVALID_ARGUMENT,
  as from its own server; a dense batch's fixed header is one `struct` call: `DenseBatch.encode`) and admits
  it without a task. Its answer is the `Consumed` frame, passed on as it is. Every other `NNWorker` call
  (`Received`, `Status`, `Stats`) is handed to the trainer as a `CALLED` message — a large request in a slot —
  and answered with the trainer's reply or status. The health service is the receiver's,
  its overall status the trainer's to
  set (`HEALTH`).

It lives as long as the link: it exits when the trainer's end closes (its server stops with a second's
grace), and it is killed with the trainer (PR_SET_PDEATHSIG). A receiver killed on its own is replaced by
the trainer (`ReceiverLink`); its callers see their calls fail and send them again, as to any restarted
service.

    python -m services.nn_worker.receiver REPLICA
"""
from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import signal
import socket
import sys

import grpc
import uvloop

from hybridrec.core.runtime import log, rpc
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import Config, split_address
from hybridrec.core.wire.frames import Applied, max_request_bytes
from hybridrec.core.model.pooling import Pooler
from hybridrec.core.wire.proto import pb
from services.nn_worker.receiver import link
from services.nn_worker.receiver.link import CONFIG_FD_ENV, LINK_FD_ENV, Message, Slot, nn_methods
from services.nn_worker.routing import BatchLost, EmbeddingWorkers

_PR_SET_PDEATHSIG = 1
STATUS_OF = {code.value[0]: code for code in grpc.StatusCode}


class Receiver:
    def __init__(self, sock: socket.socket, config: Config, replica: int):
        self.sock, self.config, self.replica = sock, config, replica
        self.reader = link.LinkReader(sock)
        self.writer = link.LinkWriter(sock)
        self.workers = EmbeddingWorkers(config)
        self.pooler = Pooler(config.features, ValueCodec(fp16=config.training.compression.fp16,
                                                         kappa=config.training.compression.kappa))
        self.slots: dict[int, Slot] = {}  # the trainer's
        self.inbound: list[Slot] = []  # this process's, for requests to the NN worker
        self.free_inbound: list[Slot] = []
        self.forwarded: dict[int, tuple[asyncio.Future, Slot | None]] = {}
        self._calls = itertools.count(1)
        self.tasks: set[asyncio.Task] = set()
        self.server: grpc.aio.Server | None = None
        self.health = None
        self.trainer_gone = asyncio.Event()  # the trainer closed its end of the socket: this process stops

    # -- messages from the trainer ------------------------------------------------------------------
    def on_readable(self) -> None:
        self.reader.drain(self.on_message, self.trainer_gone.set)

    def on_message(self, message: Message, fds: list[int]) -> None:
        if message.op == link.SLOT:
            self.slots[message.slot] = Slot(message.slot, fds[0])
        elif message.op in (link.REPLY, link.REFUSE):
            entry = self.forwarded.pop(message.call, None)
            if entry is not None:
                future, slot = entry
                if slot is not None:
                    self.free_inbound.append(slot)  # the trainer has read the request
                if not future.cancelled():
                    future.set_result(message)
        else:
            self._start(self.serve_call(message) if message.op in (link.LOOKUP, link.PUSH)
                        else self.control(message))

    def _start(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def send(self, message: Message, fd: int | None = None) -> None:
        self.writer.send(message, fd)  # to a trainer that is gone: dropped, and the reader sees the end

    # -- the trainer's calls to the embedding workers ---------------------------------------------------
    async def serve_call(self, message: Message) -> None:
        try:
            if message.op == link.LOOKUP:
                checked = self.pooler.check(await self.workers.call_lookup(message.ref), message.nbytes)
                nbytes = checked.encode_into(self.slots[message.slot].writable)
                answer = Message(link.DONE, message.call, message.ref, message.slot, nbytes)
            else:
                frame = bytes(self.slots[message.slot].view(message.nbytes))
                applied = Applied.decode(await self.workers.call_push(message.ref, frame))
                answer = Message(link.DONE, message.call, message.ref, message.slot,
                                 payload=link.pack_applied(applied))
        except BatchLost as exc:
            answer = Message(link.LOST, message.call, message.ref, message.slot, payload=str(exc).encode())
        except rpc.Unavailable as exc:
            answer = Message(link.UNAVAILABLE, message.call, message.ref, message.slot, payload=str(exc).encode())
        except Exception as exc:  # noqa: BLE001 - the trainer raises it; the receiver goes on
            answer = Message(link.FAILED, message.call, message.ref, message.slot,
                             payload=f"{type(exc).__name__}: {exc}".encode()[:4096])
        self.send(answer)

    # -- the NN worker's server -------------------------------------------------------------------------
    async def control(self, message: Message) -> None:
        if message.op == link.SERVE:
            try:
                port = await self.start_server()
            except Exception as exc:  # noqa: BLE001 - the trainer's start fails with it
                self.send(Message(link.FAILED, message.call, payload=f"{type(exc).__name__}: {exc}".encode()))
                return
            self.send(Message(link.LISTENING, message.call, nbytes=port))
        elif message.op == link.HEALTH:
            if self.health is not None:
                await rpc.set_serving(self.health, bool(message.nbytes))

    async def start_server(self) -> int:
        if self.server is not None:
            return self.port
        address = self.config.cluster.nn_workers[self.replica]
        self.server = rpc.new_server(max_request_bytes(self.config))
        self.health = rpc.add_health(self.server)
        handlers = {method.name: grpc.unary_unary_rpc_method_handler(
                        self._forwarder(index, link.BATCH if method.name == "PutBatch" else link.CALLED))
                    for index, method in enumerate(nn_methods())}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            pb.DESCRIPTOR.services_by_name["NNWorker"].full_name, handlers),))
        self.port = await rpc.start_server(self.server, self.health, self.config.cluster.bind_host,
                                           split_address(address)[1])
        return self.port

    def _forwarder(self, index: int, op: int):
        """The handler of method `index`: its request handed to the trainer as it came and answered with the
        trainer's reply or status. PutBatch's goes as a `BATCH` (the trainer decodes the data loader's frame once
        and admits it without a task, answering with the `Consumed` frame); every other call as a `CALLED`."""
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            answer = await self.forward(index, request, op)
            if answer.op == link.REPLY:
                return answer.payload
            await context.abort(STATUS_OF.get(answer.ref, grpc.StatusCode.INTERNAL),
                                answer.payload.decode(errors="replace"))
        return forward

    async def forward(self, ref: int, request: bytes, op: int = link.CALLED) -> Message:
        """Hand a request to the trainer as it came (a call of method `ref`, or a data loader's frame as a `BATCH`)
        and wait for its answer. A request too large for a message goes in an inbound slot, which is
        free again once the trainer has answered (not when the caller gives up: the trainer may not have read
        it yet)."""
        if len(request) <= link.INLINE_BYTES:
            return await self._handed(op, ref, None, len(request), request)
        slot = self._inbound_slot()
        slot.writable(len(request))[:] = request
        return await self._handed(op, ref, slot, len(request))

    async def _handed(self, op: int, ref: int, slot: Slot | None, nbytes: int, payload: bytes = b"") -> Message:
        call = next(self._calls) & 0xFFFFFFFF
        future = asyncio.get_running_loop().create_future()
        self.forwarded[call] = (future, slot)
        self.send(Message(op, call, ref, link.NO_SLOT if slot is None else slot.index, nbytes, payload))
        return await future

    def _inbound_slot(self) -> Slot:
        if self.free_inbound:
            return self.free_inbound.pop()
        slot = Slot.create(len(self.inbound), link.INITIAL_INBOUND_BYTES)
        self.inbound.append(slot)
        self.send(Message(link.INBOUND_SLOT, slot=slot.index), slot.fd)
        return slot

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        await self.workers.close()


async def run(sock: socket.socket, config: Config, replica: int) -> None:
    receiver = Receiver(sock, config, replica)
    loop = asyncio.get_running_loop()
    loop.add_reader(sock.fileno(), receiver.on_readable)
    try:
        await receiver.trainer_gone.wait()
    finally:
        loop.remove_reader(sock.fileno())
        receiver.writer.close()
        await receiver.stop()


def main() -> None:
    replica = int(sys.argv[1])
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the trainer
    with open(int(os.environ[CONFIG_FD_ENV]), "rb") as f:
        config = Config.model_validate_json(f.read())
    log.setup(service="nn_receiver", replica=replica)
    rpc.tune_allocator()
    rpc.use_tls(config.cluster.tls)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer's stop closes the link; a pod's goes to all
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(os.environ[LINK_FD_ENV]))
    sock.setblocking(False)
    uvloop.run(run(sock, config, replica))
    log.get().info("receiver_done")


if __name__ == "__main__":
    main()
