"""Where a restarted data loader continues: services/dataloader/resume.py's plan from the ranks' answers."""
from __future__ import annotations

from hybridrec.core.wire.frames import Received
from services.dataloader.batching import Position
from services.dataloader.resume import plan

NO_CHECKPOINT = (Position(), 0)


def _pos(seq: int) -> tuple[int, ...]:
    """A made-up position after batch `seq` (each batch 100 lines)."""
    return (0, 0, (seq + 1) * 1000, (seq + 1) * 100 + 1)


def _rank(rank: int, ranks: int, received: int, trained: int = -1, ended=(), eval_through: int = -1) -> Received:
    """Rank `rank` received batches rank, rank+N, ... up to `received` (each 100 samples, with marks)."""
    seqs = list(range(rank, received + 1, ranks))
    marks = [(s, _pos(s), 100 * (i + 1)) for i, s in enumerate(seqs)]
    return Received({"train": max(received, trained), "eval": eval_through}, frozenset(ended), marks)


def test_a_first_start_begins_at_the_newest_checkpoint_or_the_start():
    fresh = [Received(), Received()]
    assert plan(fresh, NO_CHECKPOINT).source == "start"
    resume = plan(fresh, (Position(0, 0, 5000, 501), 10))
    assert resume.source == "checkpoint" and resume.position == Position(0, 0, 5000, 501)
    assert resume.train.first_seq == 10 and not resume.train.skip_through


def test_resumes_after_the_last_round_every_rank_holds():
    # rank 0 holds 0, 2, ..., 20; rank 1 holds 1, 3, ..., 17: rounds 0..8 complete (through batch 17)
    resume = plan([_rank(0, 2, 20), _rank(1, 2, 17)], NO_CHECKPOINT)
    assert resume.source == "ranks" and resume.train.first_seq == 18
    assert resume.position == Position(*_pos(17))
    assert resume.train.skip_through == (20, 17)
    # batches 18 and 20 are read again but rank 0 holds them; 19 goes to rank 1
    assert [s for s in range(18, 24) if not resume.train.skips(s % 2, s)] == [19, 21, 22, 23]
    assert resume.train.rows_sent == (1100, 900)  # each rank's samples through what it holds


def test_a_round_whose_end_nobody_remembers_falls_back_to_an_earlier_one():
    # rank 1 (the last of each round) is a replacement: the group trained through 17, it received nothing since
    rank1 = Received({"train": 17, "eval": -1}, frozenset(), [])
    resume = plan([_rank(0, 2, 20), rank1], (Position(0, 0, 8000, 801), 8))
    assert resume.source == "checkpoint" and resume.train.first_seq == 8 and resume.notes
    assert resume.train.rows_sent[1] is None  # not known: counted afresh
    assert plan([_rank(0, 2, 20), rank1], NO_CHECKPOINT).train.first_seq == 0


def test_a_checkpoint_newer_than_what_the_ranks_hold_is_not_used():
    resume = plan([_rank(0, 2, 4), _rank(1, 2, 5)], (Position(0, 0, 99000, 9901), 98))
    assert resume.train.first_seq == 6 and resume.source == "ranks"


def test_after_training_the_loader_sends_only_missing_evaluation_batches():
    ranks = [_rank(0, 2, 20, ended={"train"}, eval_through=6), _rank(1, 2, 21, ended={"train"}, eval_through=3)]
    resume = plan(ranks, NO_CHECKPOINT)
    assert resume.train_done and resume.eval.first_seq == 0
    assert [s for s in range(10) if not resume.eval.skips(s % 2, s)] == [5, 7, 8, 9]


def test_the_end_of_training_on_only_some_ranks_reads_training_again():
    ranks = [_rank(0, 3, 30, ended={"train"}), _rank(1, 3, 28), _rank(2, 3, 26)]
    resume = plan(ranks, NO_CHECKPOINT)
    assert not resume.train_done and resume.train.first_seq == 27
    assert resume.train.skips(0, 30) and not resume.train.skips(1, 31)
