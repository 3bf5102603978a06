"""A partition of the event stream (several data loaders): how it ends, and what the replay sends where
(services/dataloader/stream.py, hybridrec/core/layouts/event_stream.py)."""
from __future__ import annotations

from pathlib import Path

from hybridrec.core.config import StreamConfig, from_dict
from hybridrec.core.layouts.event_stream import partition_of, partition_subject, subject_matches
from services.dataloader.batching import Position, ReadCounters
from services.dataloader.stream import Message, MessageReader, StreamAccount, iter_train_batches, partition

ROWS = 10  # a message's lines


class Source:
    """An EventSource over a list of messages, all there already."""

    def __init__(self, messages: list[Message]):
        self.messages, self.subject, self.first_seq, self.acknowledged, self.ended = list(messages), "s.1", 1, 0, False
        self.dead_letter_subject = "s.1.dead"
        self.dead_letters: list[tuple[int, str]] = []  # (seq, reason) of each message copied there

    def dead_letter(self, msg: Message, reason: str) -> None:
        assert msg.seq > self.acknowledged, "a dead letter must be copied before its message is acknowledged"
        self.dead_letters.append((msg.seq, reason))

    def get(self, timeout: float) -> Message | None:
        return self.messages.pop(0) if self.messages else None

    def ack_through(self, seq: int) -> None:
        self.acknowledged = max(self.acknowledged, seq)


def _lines(small_data: Path, n: int) -> list[bytes]:
    return (small_data / "train.tsv").read_bytes().splitlines(keepends=True)[:n]


def _read(source: Source, until: int, *, start: Position = Position()):
    account = StreamAccount(source, partition=1)
    config = StreamConfig(subject="s", until_event=until, linger_s=0.01)
    reader = MessageReader(from_dict({"data": {"train": ["t"]}}), source.subject)
    batches = list(iter_train_batches(source, account, config, start=start, batch_size=25, reader=reader,
                                      counters=ReadCounters()))
    return batches, account


def _partition_one_of_three(small_data: Path, events: int, *, marker_at: int | None) -> list[Message]:
    """Partition 1 of a replay of `events` lines, ROWS a message, 3 partitions: messages 1, 4, 7, ... of the
    replay at stream sequences 2, 5, 8, ..., then (`marker_at`) its end marker, with the replay's end id."""
    lines = _lines(small_data, events)
    out = [Message(m + 1, b"".join(lines[m * ROWS:(m + 1) * ROWS]), m * ROWS, 0.0)
           for m in range(1, -(-events // ROWS), 3)]
    if marker_at is not None:
        out.append(Message(out[-1].seq + 3, b"", marker_at, 0.0))
    return out


def test_a_partition_ends_at_the_replays_end_marker_and_notes_it_for_acknowledgement(small_data):
    """Events 0..199 in 20 messages; partition 1 holds messages 1, 4, ..., 19 (events 10..19, ..., 190..199),
    so with until_event 200 it holds the last event and ends on it; with until_event 180 its last message
    (170..179) ends before it: the marker (id 200) says nothing more comes."""
    batches, account = _read(Source(_partition_one_of_three(small_data, 200, marker_at=200)), until=200)
    assert sum(len(rows) for rows, _ in batches) == 70 and account.end_marker is None  # it held event 199
    messages = _partition_one_of_three(small_data, 180, marker_at=180)
    batches, account = _read(Source(messages), until=180)
    assert sum(len(rows) for rows, _ in batches) == 60 and account.end_marker == messages[-1].seq
    assert batches[-1][1] == Position(0, 0, messages[-2].seq, 1)  # the marker is not in a batch's position


def test_an_earlier_replays_marker_is_passed_over(small_data):
    """A marker whose id is before until_event (a replay that ended, and another went on after it) holds
    nothing and ends nothing; the partition goes on to the next replay's messages."""
    first = _partition_one_of_three(small_data, 90, marker_at=90)  # messages 1, 4, 7 + marker
    later = [Message(first[-1].seq + 1 + i, m.data, 90 + 10 * i, 0.0) for i, m in enumerate(first[:2])]
    batches, account = _read(Source(first + later + [Message(99, b"", 200, 0.0)]), until=200)
    assert sum(len(rows) for rows, _ in batches) == 50 and account.end_marker == 99


def test_partition_subjects_and_names():
    assert partition(0, 1) is None and partition(2, 3) == 2
    assert partition_subject("hybridrec.events", None) == "hybridrec.events"
    assert partition_subject("hybridrec.events", 2) == "hybridrec.events.2"
    assert [partition_of(m, 3) for m in range(7)] == [0, 1, 2, 0, 1, 2, 0] and partition_of(5, 1) is None
    assert subject_matches("hybridrec.events.*", "hybridrec.events.2")
    assert not subject_matches("hybridrec.events.*", "hybridrec.events")
    assert subject_matches("hybridrec.>", "hybridrec.events.0") and not subject_matches("a.b", "a.b.c")
