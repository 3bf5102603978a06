"""A data loader restarted mid-stream goes on with its predecessor's account (services/dataloader/stream.py):
the summary's events and lag cover the whole job, and the batches the ranks may hold from the predecessor are
read again exactly as it cut them, a batch it sent early because the stream paused included."""
from __future__ import annotations

import json
from pathlib import Path

from hybridrec.core.config import StreamConfig, from_dict
from services.dataloader.batching import Position, ReadCounters
from services.dataloader.stream import Message, MessageReader, StreamAccount, iter_train_batches
from tests.unit.test_stream_partitions import Source

ROWS, BATCH = 10, 25


def _messages(small_data: Path, count: int) -> list[Message]:
    lines = (small_data / "train.tsv").read_bytes().splitlines(keepends=True)
    return [Message(m + 1, b"".join(lines[m * ROWS:(m + 1) * ROWS]), m * ROWS, 1000.0 + m) for m in range(count)]


def _batches(items: list, account: StreamAccount, *, start: Position = Position(), until: int = 10 ** 9, take=None):
    """(samples, position) of the batches read from `items` (a None is a pause of the stream: linger_s passes)."""
    reader = MessageReader(from_dict({"data": {"train": ["t"]}}), "s.1")
    config = StreamConfig(subject="s", until_event=until, linger_s=0.01)
    out = []
    for rows, position in iter_train_batches(account.source, account, config, start=start, batch_size=BATCH,
                                             reader=reader, counters=ReadCounters()):
        out.append((len(rows), position))
        if take is not None and len(out) == take:
            break
    return out


def test_a_restarted_loader_cuts_the_batches_the_ranks_may_hold_where_its_predecessor_did(small_data, tmp_path):
    messages = _messages(small_data, 12)
    # The predecessor: the stream pauses after message 6, so its third batch goes out with 10 samples.
    first = StreamAccount(Source(messages[:6] + [None] + messages[6:]), str(tmp_path), job="j")
    before = _batches(first.source.messages, first, take=4)
    assert [n for n, _ in before] == [25, 25, 10, 25]
    assert before[2][1] == Position(0, 0, 6, 1)  # cut early by the pause, at message 6's end
    # It dies; the ranks hold its first two batches (a round of 2): the new loader resumes after batch 1.
    resume = before[1][1]
    again = StreamAccount(Source([m for m in messages if m.seq > resume.offset]), str(tmp_path), job="j")
    again.inherit(resume)
    after = _batches(again.source.messages, again, start=resume, until=120)
    assert after[:2] == before[2:4]  # the very batches, though the stream no longer pauses there
    assert sum(n for n, _ in before[:2]) + sum(n for n, _ in after) == 120
    # Without the predecessor's account it would have cut the third batch full, unlike the one a rank holds.
    (tmp_path / "other").mkdir()
    fresh = StreamAccount(Source([m for m in messages if m.seq > resume.offset]), str(tmp_path / "other"), job="j")
    assert _batches(fresh.source.messages, fresh, start=resume, until=120)[0] != before[2]

    # Its account goes on: the two held batches count as trained with its first, then its own.
    again.trained([p for _, p in after])
    summary = again.summary()
    assert summary.events == 120 and summary.loader_restarts == 1 and summary.first_seq == 1, summary
    assert summary.training_lag_s is not None and summary.training_lag_s.p50 > 0
    again.write_summary()  # at the end of training (while training: at most once a second)
    state = json.loads((tmp_path / "stream.json").read_text())
    assert state["events"] == 120 and state["pending"] == [] and state["job"] == "j"


def test_an_account_goes_on_across_lives_and_not_across_jobs(small_data, tmp_path):
    messages = _messages(small_data, 6)
    first = StreamAccount(Source(messages), str(tmp_path), job="j")
    batches = _batches(first.source.messages, first, until=60)
    first.trained([p for _, p in batches[:1]])  # 25 events trained and written, the rest read
    first.write_summary()
    second = StreamAccount(Source([]), str(tmp_path), job="j")
    second.inherit(batches[1][1])  # the ranks hold the second batch too
    second.settle_held()
    assert second.summary().events == 50 and second.summary().loader_restarts == 1
    lag = second.summary().training_lag_s
    assert lag is not None and lag.p50 <= lag.p99 <= lag.max
    other = StreamAccount(Source([]), str(tmp_path), job="k")  # another job's file: a fresh account
    other.inherit(batches[1][1])
    assert other.summary().events == 0 and other.summary().loader_restarts == 0


class _Refetching(Source):
    """A Source whose messages can be read again from the consumer's floor (`acknowledge_read`)."""

    def __init__(self, messages: list[Message]):
        super().__init__(messages)
        self.reread: list[tuple[int, float]] = []

    def acknowledge_read(self, through: int, timeout_s: float) -> None:
        self.reread.append((through, timeout_s))
        self.ack_through(through)


def test_a_loader_restarted_after_training_ended_counts_and_acknowledges_what_its_predecessor_read(small_data,
                                                                                                   tmp_path):
    """The predecessor read and sent every batch, the ranks trained them all, and it died before it
    acknowledged them: the new loader (the ranks say training is done) counts every one of them and has their
    messages acknowledged, so the next job of the consumer does not read them again."""
    messages = _messages(small_data, 6)
    first = StreamAccount(Source(messages), str(tmp_path), job="j")
    batches = _batches(first.source.messages, first, until=60)
    assert [n for n, _ in batches] == [25, 25, 10] and first.source.acknowledged == 0
    second = StreamAccount(_Refetching([]), str(tmp_path), job="j")
    second.settle_finished(retry_s=7.0)
    assert second.source.reread == [(6, 7.0)]  # every message whole in a trained batch
    summary = second.summary()
    assert summary.events == 60 and summary.loader_restarts == 1 and summary.acknowledged_through == 6, summary
    assert json.loads((tmp_path / "stream.json").read_text())["pending"] == []
    # Acknowledged already by the predecessor: nothing is read again.
    third = StreamAccount(_Refetching([]), str(tmp_path), job="j")
    third.settle_finished(retry_s=7.0)
    assert third.source.reread == [] and third.summary().events == 60
