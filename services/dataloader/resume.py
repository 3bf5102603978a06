"""On a restarted data loader: where the streams continue, from what the NN workers hold.

The NN workers, not the loader, know how far training has come: each rank
holds every batch of its share up to some stream index (in its inbox, or
trained by the group), and remembers where the data ended after its latest
training batches (`frames.Received`). A restarted loader asks every rank, and

* reads training data again from the end of the last *round* (one batch per
  rank) that every rank holds and whose end position it finds — a round
  boundary, so batch k still goes to rank k mod N and the final, split round
  comes out as it did; failing that, from the newest checkpoint, or the start;
* sends a rank only the batches after the last one it holds, so nothing is
  trained twice and no embedding worker buffers a batch nobody will take;
* numbers every batch, and counts each rank's samples, as the first loader did.

No checkpoint is read unless the ranks' marks fall short, and no NN worker
restarts: a loader killed mid-run costs the batches re-read between the round
boundary and the ranks' inboxes (a few), not the run since the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from hybridrec.core.wire.frames import Received
from services.dataloader.batching import Position


@dataclass(frozen=True)
class PhaseResume:
    """Where one phase's stream continues."""

    first_seq: int = 0
    """Stream index of the first batch the loader reads again (a multiple of the number of ranks)."""
    skip_through: tuple[int, ...] = ()
    """Per rank, the last stream index it holds: batches up to it are read but not sent."""
    rows_sent: tuple[int | None, ...] = ()
    """Per rank, the samples of the phase sent to it through `skip_through` (None: not known; counted afresh)."""

    def skips(self, rank: int, seq: int) -> bool:
        return bool(self.skip_through) and seq <= self.skip_through[rank]


@dataclass(frozen=True)
class Resume:
    """What a (re)started loader does: where training reading starts, and what each rank still needs."""

    position: Position = Position()
    train: PhaseResume = PhaseResume()
    eval: PhaseResume = PhaseResume()
    train_done: bool = False
    """Every rank has the end of training: the loader goes straight to evaluation."""
    source: str = "start"
    """Where `position` came from: start, checkpoint or ranks."""
    notes: list[str] = field(default_factory=list)


def plan(received: Sequence[Received], checkpoint: tuple[Position, int]) -> Resume:
    """The resume plan from every rank's answer (in rank order) and the newest checkpoint's (position, next
    stream index) — (Position(), 0) without one."""
    ranks = len(received)
    checkpoint_position, checkpoint_seq = checkpoint
    if all(r.through["train"] < 0 and not r.ended for r in received):  # a first start, or a group restart
        return Resume(checkpoint_position, PhaseResume(checkpoint_seq),
                      source="checkpoint" if checkpoint_seq else "start")
    evaluation = _phase(received, "eval", rounds=None)
    if all("train" in r.ended for r in received):
        return Resume(train_done=True, eval=evaluation, source="ranks")
    # Rounds every rank holds completely: rank r holds r, r+N, ..., through[r].
    held = min((r.through["train"] - rank) // ranks + 1 for rank, r in enumerate(received))
    candidates = {0: (Position(), "start")}  # rounds -> (position after them, where that came from)
    if checkpoint_seq <= held * ranks and checkpoint_seq % ranks == 0:
        candidates[checkpoint_seq // ranks] = (checkpoint_position, "checkpoint")
    for r in received:
        for seq, position, _ in r.marks:
            if (seq + 1) % ranks == 0 and seq + 1 <= held * ranks:
                candidates[(seq + 1) // ranks] = (Position(*position), "ranks")
    rounds = max(candidates)
    position, source = candidates[rounds]
    notes = [] if rounds == held else [f"the ranks hold {held} rounds, but the end of only {rounds} is known: "
                                       f"{(held - rounds) * ranks} batches are read again and not sent"]
    return Resume(position, _phase(received, "train", rounds), evaluation, source=source, notes=notes)


def _phase(received: Sequence[Received], phase: str, rounds: int | None) -> PhaseResume:
    """Skip what each rank holds; count samples on from its mark of the last batch it holds (training)."""
    through = tuple(r.through[phase] for r in received)
    rows = tuple(next((n for seq, _, n in r.marks if seq == r.through[phase]), None) if phase == "train" else None
                 for r in received)
    first = rounds * len(received) if rounds is not None else 0
    return PhaseResume(first, through, rows)
