"""On the NN worker: where this rank stands in each data loader's stream, with one owner.

Every data loader numbers its batches on its own (rank r of N gets r, r+N, ...). A rank's place in each stream
has two sides that must agree:

* the **receiving side** (the servicer, on the event loop): which batches and ends it took into its inbox, the
  ends of recent training batches a restarted loader resumes from (`marks`), and which batch it refuses as out
  of order (a replacement owes its predecessor's batches first);
* the **training side** (the trainer): its next batch of each stream, which it trained, which of those still
  wait for their embedding update's acknowledgement, and so what the loader may forget (`consumed`: the
  PutBatch reply), the steps the group trained on each loader's batches, and a replacement's hand-over.

`Ledger` holds both, so neither the servicer nor the trainer reads the other's fields: each calls the ledger.
Its methods are plain synchronous code, testable without a server, a group or an event loop.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from hybridrec.core.runtime import rpc
from hybridrec.core.wire.frames import PHASES, POSITION_FIELDS, Consumed, DenseBatch, EndOfPhase

MARKS_KEPT = 256
"""Recent training batches whose ends a rank remembers for a restarted data loader: far more than the ranks
can drift apart (each holds at most its inbox and prefetch ahead of the group's step)."""

Mark = tuple[int, tuple[int, ...], int]
"""A training batch's stream index, its position in the loader's input, and the rows the loader had sent
through it: where a restarted loader resumes after it."""


@dataclass
class LoaderState:
    """One data loader's stream as this rank sees it."""

    next_seq: int
    """This rank's next training batch of the stream (r gets r, r+N, ...)."""
    received: dict[str, int] = field(default_factory=lambda: {phase: -1 for phase in PHASES})
    """Per phase, the newest batch taken into the inbox."""
    ended: set[str] = field(default_factory=set)
    """Phases whose end is in the inbox."""
    marks: deque[Mark] = field(default_factory=lambda: deque(maxlen=MARKS_KEPT))
    trained_through: int = -1
    """The newest training batch this rank trained or settled."""
    unacked: set[int] = field(default_factory=set)
    """Trained, its embedding update not yet acknowledged."""
    consumed: Consumed = field(default_factory=Consumed)
    """What PutBatch answers: the loader forgets up to here."""
    steps: int = 0
    """Steps the group trained on this loader's batches (every rank alike)."""
    uncounted: bool = False
    """A replacement: its predecessor's share of this stream is not yet in its sample count."""


class Order(Enum):
    """Where a training batch taken from the inbox stands against the rank's next one (`Ledger.take`)."""

    NEXT = "next"
    """The next batch of this rank's share: train it."""
    SETTLE = "settle"
    """Trained by the group already (a re-sent batch of a lost predecessor): settle its update, do not train."""


class Ledger:
    """Rank `rank` of `world_size`'s place in each of `loaders` data loaders' streams (module docstring)."""

    def __init__(self, rank: int, world_size: int, loaders: int):
        self.rank, self.world_size = rank, world_size
        self.loaders = [LoaderState(next_seq=rank) for _ in range(loaders)]
        self.ends_taken: dict[str, dict[int, EndOfPhase]] = {phase: {} for phase in PHASES}
        """Each phase's ends the trainer took from the inbox."""
        self.opened = False
        """Whether the group's state is known (set once the trainer has joined and restored): before it, a
        training batch cannot be placed."""

    def open(self) -> None:
        """The group's state is known (joined, and restored or handed over): training batches can be placed."""
        self.opened = True

    def __len__(self) -> int:
        return len(self.loaders)

    # -- the training side --------------------------------------------------------------------
    def resume_at(self, loader_steps: list[int]) -> None:
        """The group's state is `loader_steps[l]` steps on loader l's batches, for each l: this rank's next
        training batch of that loader's stream is loader_steps[l]*N + rank."""
        self._place(loader_steps)
        self._confirm_all()

    def take_over(self, loader_steps: list[int]) -> None:
        """A replacement of a lost rank: the group's state is `loader_steps` (`resume_at`), and its predecessor's
        place in each stream is taken without confirming or counting what it did not see.

        It confirms only what it received: the predecessor may have trained batches whose embedding updates
        died with it. Confirming the group's state would let the loaders forget them unsent; instead they are
        sent again, oldest first, and each is confirmed once it is settled (`settled`). Its predecessor's share
        of each stream is counted with the first batch or end taken of it (`count_predecessor`)."""
        self._place(loader_steps)
        for state in self.loaders:
            state.trained_through = -1
            state.uncounted = True
        self._confirm_all()

    def _place(self, loader_steps: list[int]) -> None:
        """Each stream's steps and this rank's next batch of it; everything before that batch trained."""
        if len(loader_steps) != len(self.loaders):
            raise ValueError(f"the group's state has {len(loader_steps)} data loaders' streams, this job "
                             f"{len(self.loaders)} (cluster.dataloader)")
        for state, steps in zip(self.loaders, loader_steps):
            state.steps = steps
            state.next_seq = steps * self.world_size + self.rank
            state.trained_through = state.next_seq - 1

    @property
    def loader_steps(self) -> list[int]:
        return [state.steps for state in self.loaders]

    @property
    def next_seqs(self) -> list[int]:
        """Each stream's next training batch of this rank: the order every rank takes loaders in
        (`inbox.next_loader`)."""
        return [state.next_seq for state in self.loaders]

    def take(self, batch: DenseBatch) -> Order:
        """Place a training batch taken from the inbox: NEXT advances this rank's place; SETTLE marks a re-sent
        batch the group trained already as owed (confirmed once `settled`). Raises on a gap in the stream."""
        state = self.loaders[batch.loader]
        if batch.seq < state.next_seq:
            state.unacked.add(batch.seq)
            state.trained_through = max(state.trained_through, batch.seq)
            return Order.SETTLE
        if batch.seq > state.next_seq:
            raise RuntimeError(
                f"NN worker rank {self.rank} expected training batch {state.next_seq} of data loader "
                f"{batch.loader}'s stream and got {batch.seq}: the data loader is ahead of the group's state (every "
                f"NN worker was lost and the group went back to a checkpoint) — restart the data loaders with the "
                f"group")
        state.next_seq += self.world_size
        return Order.NEXT

    def check_end(self, end: EndOfPhase) -> None:
        """A loader's end of training comes after every batch of this rank's share, or the rank is behind it."""
        next_seq = self.loaders[end.loader].next_seq
        expected = next_seq - self.rank
        if end.end_seq >= 0 and end.end_seq != expected:
            raise RuntimeError(
                f"NN worker rank {self.rank} got the end of data loader {end.loader}'s training stream at "
                f"batch {end.end_seq} while at batch {next_seq} of it: the data loader is "
                f"{'ahead of' if end.end_seq > expected else 'behind'} the group's state (every NN worker was lost "
                f"and the group went back to a checkpoint) — restart the data loaders with the group")

    def count_predecessor(self, loader: int, rows: int) -> int:
        """A replacement: the `rows` of `loader`'s stream its predecessor's share held (the group trained them),
        counted once, with the first batch or end taken of that loader; 0 for any later one."""
        state = self.loaders[loader]
        if not state.uncounted:
            return 0
        state.uncounted = False
        return rows

    @property
    def samples_counted(self) -> bool:
        """Whether this rank's sample count is its share of the job's: False for a replacement until it has
        counted its predecessor's share of every loader's stream (an interval checkpoint waits for it)."""
        return not any(state.uncounted for state in self.loaders)

    def trained(self, batch: DenseBatch) -> None:
        """A training step on `batch` is done: its update is owed until `acknowledged`."""
        state = self.loaders[batch.loader]
        state.steps += 1
        state.trained_through = batch.seq
        state.unacked.add(batch.seq)
        self._confirm(state)

    def acknowledged(self, loader: int, seq: int) -> None:
        """A trained batch's embedding update is answered (applied, or counted as lost)."""
        state = self.loaders[loader]
        state.unacked.discard(seq)
        self._confirm(state)

    def settled(self, loader: int, seq: int) -> None:
        """A re-sent batch's owed update is settled (`Order.SETTLE`); confirmed unless evaluation has begun."""
        state = self.loaders[loader]
        state.unacked.discard(seq)
        if state.consumed.phase == "train":
            self._confirm(state)

    def predicted(self, loader: int, seq: int) -> None:
        """An eval batch is predicted: the loader may forget it."""
        self.loaders[loader].consumed = Consumed("eval", seq)

    def _confirm_all(self) -> None:
        for state in self.loaders:
            self._confirm(state)

    def _confirm(self, state: LoaderState) -> None:
        """A loader forgets a batch once it is trained *and* its embedding update is acknowledged, so a
        replacement of this rank is sent again what its predecessor still owed."""
        through = min(state.unacked) - self.world_size if state.unacked else state.trained_through
        state.consumed = Consumed("train", through)

    # -- the receiving side -------------------------------------------------------------------
    def is_fresh(self, item: DenseBatch | EndOfPhase) -> bool:
        """Whether `item` is new to this rank; raises for a training batch out of order (`check_in_order`)."""
        state = self.loaders[item.loader]
        if isinstance(item, EndOfPhase):
            return item.phase not in state.ended
        if item.phase == "train":
            self.check_in_order(item)
        return item.seq > state.received[item.phase]

    def received(self, item: DenseBatch | EndOfPhase) -> None:
        """`item` is in the inbox: received, and on a training batch, where its loader resumes after it."""
        state = self.loaders[item.loader]
        if isinstance(item, EndOfPhase):
            state.ended.add(item.phase)
            return
        state.received[item.phase] = max(item.seq, state.received[item.phase])
        if item.phase == "train" and len(item.position) == POSITION_FIELDS:
            state.marks.append((item.seq, item.position, item.rows_before + item.labels.shape[0]))

    def check_in_order(self, item: DenseBatch) -> None:
        """Refuse a training batch that comes before the ones this rank's share is missing.

        A replacement of a lost rank owes the batches its predecessor had received but not trained. The
        loader sends them again after a call that failed; but a loader that sent nothing while the rank was
        replaced (a quiet stream) has no failed call, and its next new batch would arrive first.
        FAILED_PRECONDITION makes it send its unconfirmed frames again, oldest first (`delivery.deliver`).
        Before the group's state is known the rank cannot tell: UNAVAILABLE, which the loader waits out."""
        if not self.opened:
            raise rpc.Unavailable("the NN worker is still joining its group")
        expected = self.held(item.loader) + self.world_size  # the next batch of its share
        if item.seq > expected:
            raise rpc.FailedPrecondition(
                f"NN worker rank {self.rank} got training batch {item.seq} of data loader {item.loader}'s "
                f"stream while it holds none from batch {expected}: send the unconfirmed batches again, oldest first")

    def held(self, loader: int) -> int:
        """The last training batch of `loader`'s stream this rank holds: received into its inbox, or trained by
        the group when this process took over (a replacement, or a restored checkpoint); it got every earlier
        batch of its share."""
        state = self.loaders[loader]
        return max(state.received["train"], state.next_seq - self.world_size)

    def consumed(self, loader: int) -> Consumed:
        """How far this rank has trained (or predicted) `loader`'s stream: what PutBatch answers."""
        return self.loaders[loader].consumed
