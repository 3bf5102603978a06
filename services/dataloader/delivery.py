"""On the data loader: delivering each NN rank's frames in order, and again to a replacement.

A frame stays in its rank's window until the rank confirms, in a later
PutBatch reply (`frames.Consumed`), that it has trained (or, in evaluation,
predicted) that batch. When a call fails — the rank died, or a connection
broke — the whole unconfirmed window is sent again, oldest first, once the
rank (or its replacement) answers: a replacement picks up the batches its
predecessor had received but not trained, without anything re-read, and a
rank that already had them drops the copies by their stream index. The
window stays small because a rank's inbox applies back-pressure: about
`2 * training.prefetch + 6` frames.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from hybridrec import rpc
from hybridrec.frames import PHASES, Consumed
from hybridrec.service import at_work

END = 1 << 62
"""The stream index an end-of-phase frame is filed under: after every batch of its phase."""


@dataclass
class Window:
    """One rank's unconfirmed frames, in the order they were first sent."""

    frames: deque[tuple[str, int, bytes]] = field(default_factory=deque)  # (phase, stream index, frame)
    delivered: int = 0  # how many of `frames` the rank's current process has received
    resent: int = 0  # frames sent again after a failed call
    through: dict[str, int] = field(default_factory=dict)  # per phase, the last stream index the rank confirmed

    def confirmed(self, phase: str, seq: int) -> bool:
        """Whether the rank has confirmed batch `seq` of `phase`: through it, or into a later phase."""
        later = PHASES[PHASES.index(phase) + 1:]
        return self.through.get(phase, -1) >= seq or any(p in self.through for p in later)

    def add(self, phase: str, seq: int, frame: bytes) -> None:
        self.frames.append((phase, seq, frame))

    def confirm(self, consumed: Consumed) -> None:
        """Forget what the rank has consumed: every earlier phase, and `consumed.phase` through `through`."""
        self.through[consumed.phase] = max(self.through.get(consumed.phase, -1), consumed.through)
        done = PHASES.index(consumed.phase)
        while self.frames:
            phase, seq, _ = self.frames[0]
            if PHASES.index(phase) < done or (phase == consumed.phase and seq <= consumed.through):
                self.frames.popleft()
                self.delivered = max(0, self.delivered - 1)
            else:
                break


PutBatch = Callable[[bytes], Awaitable[bytes]]


async def deliver(window: Window, put: PutBatch, *, retry_s: float) -> None:
    """Send every frame of `window` the rank has not received, in order; after a failed call, start over from
    the oldest unconfirmed one (rpc.retry waits out a restarting rank for up to `retry_s`)."""

    async def attempt() -> None:
        try:
            while window.delivered < len(window.frames):
                reply = await put(window.frames[window.delivered][2])
                window.delivered += 1
                at_work("batch delivered")
                window.confirm(Consumed.decode(reply))
        except grpc.aio.AioRpcError:
            window.resent += window.delivered
            window.delivered = 0  # perhaps a replacement: it gets everything not yet confirmed
            raise

    await rpc.retry(attempt, deadline_s=retry_s)
