"""The NN worker's receiver: a child process that makes the trainer's calls to the embedding workers.

Started by `ReceiverLink` (link.py) when `training.receiver` is on, with two inherited file descriptors:
its end of the link's socket pair (`HYBRIDREC_LINK_FD`) and the job's config as JSON
(`HYBRIDREC_LINK_CONFIG_FD`). It runs its own
event loop and gRPC channels: for each `LOOKUP` it calls the batch's embedding worker and writes the
`Embeddings` frame into the slot it was handed; for each `PUSH` it sends the slot's `Gradients` frame.
The calls are `EmbeddingWorkers`' own (routing.py): the same routing by batch_ref, retries for
`cluster.retry_s`, and NOT_FOUND as a lost batch.

It lives as long as the link: it exits when the trainer's end closes, and it is killed with the trainer
(PR_SET_PDEATHSIG). A receiver killed on its own is replaced by the trainer (`ReceiverLink`).

    python -m services.nn_worker.receiver REPLICA
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys

from hybridrec import log, rpc
from hybridrec.config import Config
from hybridrec.frames import Applied
from services.nn_worker import link
from services.nn_worker.link import CONFIG_FD_ENV, LINK_FD_ENV, Message, Slot
from services.nn_worker.routing import BatchLost, EmbeddingWorkers

_PR_SET_PDEATHSIG = 1


class Receiver:
    def __init__(self, sock: socket.socket, workers: EmbeddingWorkers):
        self.sock, self.workers = sock, workers
        self.slots: dict[int, Slot] = {}
        self.calls: set[asyncio.Task] = set()
        self.ended = asyncio.Event()

    def on_readable(self) -> None:
        while True:
            try:
                message, fds = link.receive_with_fds(self.sock)
            except BlockingIOError:
                return
            except ConnectionError:
                message, fds = None, []
            if message is None:
                self.ended.set()
                return
            if message.op == link.SLOT:
                self.slots[message.slot] = Slot(message.slot, fds[0])
                continue
            task = asyncio.ensure_future(self.serve(message))
            self.calls.add(task)
            task.add_done_callback(self.calls.discard)

    async def serve(self, message: Message) -> None:
        try:
            if message.op == link.LOOKUP:
                frame = await self.workers.call_lookup(message.ref)
                self.slots[message.slot].writable(len(frame))[:] = frame
                answer = Message(link.DONE, message.call, message.ref, message.slot, len(frame))
            elif message.op == link.PUSH:
                frame = bytes(self.slots[message.slot].view(message.nbytes))
                applied = Applied.decode(await self.workers.call_push(message.ref, frame))
                answer = Message(link.DONE, message.call, message.ref, message.slot,
                                 payload=link.pack_applied(applied))
            else:
                raise ValueError(f"unknown link op {message.op}")
        except BatchLost as exc:
            answer = Message(link.LOST, message.call, message.ref, message.slot, payload=str(exc).encode())
        except rpc.Unavailable as exc:
            answer = Message(link.UNAVAILABLE, message.call, message.ref, message.slot, payload=str(exc).encode())
        except Exception as exc:  # noqa: BLE001 - the trainer raises it; the receiver goes on
            answer = Message(link.FAILED, message.call, message.ref, message.slot,
                             payload=f"{type(exc).__name__}: {exc}".encode()[:4096])
        try:
            link.send(self.sock, answer)
        except (BrokenPipeError, ConnectionError):
            self.ended.set()


async def run(sock: socket.socket, config: Config) -> None:
    workers = EmbeddingWorkers(config)
    receiver = Receiver(sock, workers)
    loop = asyncio.get_running_loop()
    loop.add_reader(sock.fileno(), receiver.on_readable)
    try:
        await receiver.ended.wait()
    finally:
        loop.remove_reader(sock.fileno())
        for task in list(receiver.calls):
            task.cancel()
        await workers.close()


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
    try:
        import uvloop
        uvloop.run(run(sock, config))
    except ImportError:
        asyncio.run(run(sock, config))
    log.get().info("receiver_done")


if __name__ == "__main__":
    main()
