"""On the NN worker: calls to the embedding workers, routed by the batch_ref of each batch.

The embedding worker that buffered a batch wrote its own index into the top
bits of the batch_ref (`hybridrec.core.wire.frames.make_batch_ref`), so lookups and
gradient pushes of that batch go back to it.

An embedding worker that dies (kill -9 included) fails the calls in flight
and refuses new ones with UNAVAILABLE until it is back; both are retried for
`cluster.retry_s`. The restarted worker re-attaches to its buffer on file and
serves the same batch_refs, and a push it had partly applied is re-sent under
the same update id, which the PS shards apply at most once: retrying is safe
for lookups and pushes alike. NOT_FOUND means the worker no longer has the
batch at all (its buffer directory was lost, e.g. with its machine):
`BatchLost`, which the trainer counts and skips.

With `training.receiver` the same calls run in the NN worker's receiver process (receiver/process.py), and the
trainer talks to them through `ReceiverLink` (receiver/receiver_link.py), which has this class's `lookup` and `push`.
"""
from __future__ import annotations

from typing import Callable

import grpc
import numpy as np

from hybridrec.core.runtime import rpc
from hybridrec.core.config import Config
from hybridrec.core.wire.frames import Applied, BatchRef, Gradients, worker_of_ref
from hybridrec.core.runtime.rpc import Unavailable


class BatchLost(LookupError):
    """The embedding worker no longer holds this batch (it lost its buffer): the batch is skipped and counted."""


class Looked:
    """A batch's embeddings as a lookup returned them, and how to give back the memory they lie in (a
    receiver's slot) once the step has used the arrays decoded from them: `release`, which frees it once
    however often it is called.

    `frame` is the embedding worker's `Embeddings` frame, or (`checked`) the `CheckedEmbeddings` layout the
    receiver process made of it."""

    __slots__ = ("frame", "checked", "_release")

    def __init__(self, frame: bytes | memoryview, release: Callable[[], None] | None = None, *,
                 checked: bool = False):
        self.frame, self.checked, self._release = frame, checked, release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class EmbeddingWorkers:
    """Channels to every embedding worker; `lookup` and `push` are what the trainer calls, `call_lookup` and
    `call_push` the raw calls (the receiver process makes them for the trainer)."""

    def __init__(self, config: Config):
        self.channels = [rpc.channel(a) for a in config.cluster.embedding_workers]
        self._lookups = [rpc.raw_method(ch, "EmbeddingWorker", "Lookup") for ch in self.channels]
        self._pushes = [rpc.raw_method(ch, "EmbeddingWorker", "PushGradients") for ch in self.channels]
        self.timeout_s = config.cluster.rpc_timeout_s
        self.retry_s = config.cluster.retry_s

    def _worker_of(self, ref: int) -> int:
        index = worker_of_ref(ref)
        if index >= len(self.channels):
            raise ValueError(f"batch_ref {ref} names embedding worker {index}, which does not exist")
        return index

    async def _call(self, methods, ref: int, frame: bytes) -> bytes:
        method = methods[self._worker_of(ref)]
        try:
            return await rpc.retry(lambda: method(frame, timeout=self.timeout_s), deadline_s=self.retry_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise BatchLost(exc.details()) from None
            raise Unavailable(f"embedding worker call for batch_ref {ref} failed: {exc.code().name} "
                              f"{exc.details()}") from None

    async def call_lookup(self, ref: int) -> bytes:
        """The batch's `Embeddings` frame."""
        return await self._call(self._lookups, ref, BatchRef(ref).encode())

    async def call_push(self, ref: int, frame: bytes) -> bytes:
        """Send a `Gradients` frame; returns the `Applied` frame that answers it."""
        return await self._call(self._pushes, ref, frame)

    async def lookup(self, ref: int, batch_size: int) -> Looked:
        """The batch's `Embeddings` frame (`batch_size`: its samples, which the trainer's decoding checks)."""
        return Looked(await self.call_lookup(ref))

    async def push(self, ref: int, tensors: dict[str, np.ndarray] | None, into: None = None,
                   nbytes: None = None) -> Applied:
        """Send the batch's packed gradients (`Gradients.pack_tensors`; None: a discard, its step not finite);
        returns the rows the PS applied and which life of each shard acknowledged. (`into` and `nbytes` are the
        receiver's: `ReceiverLink.push`.)"""
        frame = Gradients.encode_discard(ref) if tensors is None else Gradients.encode_packed(ref, tensors)
        return Applied.decode(await self.call_push(ref, frame))

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
