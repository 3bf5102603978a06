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

from hybridrec.core.runtime import log, rpc
from hybridrec.core.wire.frames import PHASES, Consumed
from hybridrec.core.runtime.service import at_work

END = 1 << 62
"""The stream index an end-of-phase frame is filed under: after every batch of its phase."""


@dataclass
class Window:
    """One rank's unconfirmed frames, in the order they were first sent."""

    frames: deque[tuple[str, int, bytes]] = field(default_factory=deque)  # (phase, stream index, frame)
    delivered: int = 0  # how many of `frames` the rank's current process has received
    resent: int = 0  # frames sent again after a failed call
    through: dict[str, int] = field(default_factory=dict)  # per phase, the last stream index the rank confirmed
    incarnation: int = 0  # the rank's process that received the `delivered` frames (its replies say; 0: unknown)

    def another_process(self, incarnation: int) -> bool:
        """Whether `incarnation` names another process of the rank than the one the `delivered` frames went to
        (a replacement that did not receive them: no call failed while the rank was replaced)."""
        return 0 not in (self.incarnation, incarnation) and incarnation != self.incarnation

    def answered_by(self, incarnation: int) -> bool:
        """Note the process that answered; `another_process` of it, before."""
        other = self.another_process(incarnation)
        self.incarnation = incarnation or self.incarnation
        return other

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


class DeliveryGap(RuntimeError):
    """The rank refused this loader's oldest unconfirmed frame as out of order: it expects a batch this loader
    no longer holds (it is ahead of the rank's group, e.g. a group that went back to a checkpoint)."""


async def deliver(window: Window, put: PutBatch, *, retry_s: float) -> None:
    """Send every frame of `window` the rank has not received, in order; after a failed call, start over from
    the oldest unconfirmed one (rpc.retry waits out a restarting rank for up to `retry_s`).

    A replacement of the rank that got none of the frames its predecessor held, because no call failed while
    the rank was replaced, is sent the window again from the oldest as well: when its first reply names
    another process (`Consumed.incarnation`), or when it refuses a frame as out of order (FAILED_PRECONDITION,
    its share's next batch is one it never got). If it refuses even the oldest, the gap is real and
    DeliveryGap says so."""

    async def attempt() -> None:
        try:
            while window.delivered < len(window.frames):
                reply = await put(window.frames[window.delivered][2])
                window.delivered += 1
                at_work("batch delivered")
                consumed = Consumed.decode(reply)
                if window.answered_by(consumed.incarnation) and window.delivered > 1:
                    log.get().warning("frames_sent_again", frames=len(window.frames), incarnation=consumed.incarnation,
                                      why="another process of the rank answered (a replacement)")
                    window.resent += window.delivered - 1
                    window.delivered = 0  # everything unconfirmed again (this frame too: dropped as a copy)
                    continue
                window.confirm(consumed)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and window.delivered == 0:
                raise DeliveryGap(exc.details()) from None
            window.resent += window.delivered
            window.delivered = 0  # perhaps a replacement: it gets everything not yet confirmed
            raise

    await rpc.retry(attempt, deadline_s=retry_s,
                    retry_on=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION))
