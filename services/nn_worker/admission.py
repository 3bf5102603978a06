"""On the NN worker: a data loader's PutBatch frame, decoded and admitted — the one path both of its entries take.

A frame reaches the NN worker through one of two entries: its own gRPC server's `PutBatch` (server.py), or, with
`training.receiver`, a `BATCH` message from the receiver process, which serves the rank's address instead
(`ReceiverLink`, receiver/receiver_link.py). Both call `admit_frame`, so a frame is decoded, refused and admitted
alike whichever way it came: a malformed one raises `FrameError` (INVALID_ARGUMENT, the same message), and a
batch is queued for the trainer where that need not wait (`admit_now`). Only when its loader's queue is full
does the entry await `admit` (its own way: the link without a task per batch where it can).
"""
from __future__ import annotations

from typing import Protocol

from hybridrec.core.config import Config
from hybridrec.core.wire.frames import Consumed, DenseBatch, EndOfPhase, decode_nn_batch


class Admits(Protocol):
    """What admits a decoded frame: the NN worker's servicer (`NNWorkerServicer`)."""

    def admit_now(self, item: DenseBatch | EndOfPhase) -> Consumed | None: ...

    async def admit(self, item: DenseBatch | EndOfPhase) -> Consumed: ...


def admit_frame(frame: bytes | memoryview, config: Config, loaders: int, to: Admits, *,
                copy: bool = False) -> tuple[DenseBatch | EndOfPhase, Consumed | None]:
    """Decode what a data loader sent (`loaders`: how many there are) and admit it where that need not wait:
    the item, and the answer to send — None when it must wait for room (then `await to.admit(item)`). `copy`:
    a dense batch's arrays copied out of `frame` (a receiver's slot, reused once the call is answered);
    otherwise they are views of it."""
    item = decode_nn_batch(frame, config.num_dense, config.label_columns, loaders)
    if copy and isinstance(item, DenseBatch):
        item.dense, item.labels = item.dense.copy(), item.labels.copy()
    return item, to.admit_now(item)
