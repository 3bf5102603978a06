"""The trainer's side of the link to its receiver process (`training.receiver`): `ReceiverLink` starts the
receiver, hands it the step's lookups and pushes (futures the link's reader resolves), serves the NN worker's
calls the receiver forwards, and replaces a receiver that dies, sending the new one every call still
unanswered. The transport (slots, messages) is link.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import grpc

from hybridrec.core.runtime import log, rpc
from hybridrec.core.wire.frames import Applied, DenseBatch, EndOfPhase, Gradients
from hybridrec.core.runtime.metrics import RPC_LATENCY
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime.rpc import Unavailable
from services.nn_worker import admission
from services.nn_worker.receiver.link import (BATCH, CALLED, CONFIG_FD_ENV, DONE, HEALTH, INBOUND_SLOT, INLINE_BYTES,
                                     LINK_FD_ENV, LISTENING, LOOKUP, LOST, NO_SLOT, PUSH, REFUSE, REPLY,
                                     SERVE, SLOT, UNAVAILABLE, LinkReader, LinkWriter, Message, Slot, nn_methods,
                                     socket_pair, unpack_applied)
from services.nn_worker.routing import BatchLost, Looked

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
        self.admits: admission.Admits | None = None  # the NN worker's servicer, for the receiver's BATCH messages
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
        return self._start(LOOKUP, ref, slot, batch_size, lambda answer: Looked(
            slot.view(answer.nbytes), lambda: self.free.append(slot), checked=True))

    def push(self, ref: int, tensors: dict | None, into: Slot | None = None,
             nbytes: int | None = None) -> asyncio.Future:
        """Send the batch's packed gradients (None: a discard); a future of the `Applied` answer
        (routing.EmbeddingWorkers.push). `into`: a slot from `outgoing`, which holds the frame already when
        `nbytes` is given (the trainer's compute thread wrote it)."""
        slot = into if into is not None else self._slot()
        if nbytes is None:
            try:
                nbytes = (Gradients.encode_discard_into(slot.writable, ref) if tensors is None
                          else Gradients.encode_packed_into(slot.writable, ref, tensors))
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
        itself as what admits the data loaders' frames (`BATCH`: `admission.admit_frame`)."""
        self.service_name, self.admits = proto_service, impl
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
        """A data loader's PutBatch, handed over as it came: decoded here, once, and admitted by the path the NN
        worker's own server takes (`admission.admit_frame`: a malformed frame is refused with INVALID_ARGUMENT
        alike; a dense batch's fixed header is one `struct` call), answered at once where that need not wait
        (the common case: no task), else by a task that waits for room in the inbox."""
        started = time.perf_counter()
        try:
            if self.admits is None:
                raise Unavailable("the NN worker is starting")
            item, consumed = admission.admit_frame(self._frame(message), self.config, self.loaders, self.admits,
                                                   copy=True)
        except Exception as exc:  # noqa: BLE001 - answered as rpc.guard answers it; the link goes on
            self._answer_batch(self.writer, self._refusal(message.call, exc), started)
            return
        if consumed is not None:
            self._answer_batch(self.writer, Message(REPLY, message.call, payload=consumed.encode()), started)
            return
        task = asyncio.ensure_future(self._admit(self.writer, message.call, item, started))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    def _frame(self, message: Message) -> bytes | memoryview:
        """The frame a `BATCH` message carries: in the message, or in one of the receiver's slots (which it reuses
        once the call is answered: `admit_frame` copies a dense batch's arrays out, writable either way)."""
        return message.payload if message.slot == NO_SLOT else self.inbound[message.slot].view(message.nbytes)

    async def _admit(self, writer: LinkWriter, call: int, item: DenseBatch | EndOfPhase, started: float) -> None:
        try:
            answer = Message(REPLY, call, payload=(await self.admits.admit(item)).encode())
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
            root = str(Path(__file__).resolve().parents[3])
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
