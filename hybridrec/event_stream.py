"""The event stream's message format, shared by its writer (`hybridrec data replay`) and its reader (the data
loader with `data.stream`, services/dataloader/stream.py).

A message on the stream's subject holds one or more samples as lines in the training data's row format
(Criteo TSV). Its headers name the id of its first event (the ids of its lines follow it) and its event
time. Event ids make every sample countable end to end: which ones were trained, and how often.

Partitions (several data loaders, one per partition): message m of a replay goes to subject
`<subject>.<m mod P>`, and each partition ends with an end marker, a message with no lines whose event id is
the replay's end (the id after its last event): a partition whose last data message holds events before
`until_event` learns from it that no more of them will come to it. With one partition the subject is
`<subject>` itself and there is no marker.
"""
from __future__ import annotations

EVENT_ID = "Hybridrec-Event-Id"
"""Message header: the id of the message's first event; its lines' ids follow it."""
EVENT_TIME = "Hybridrec-Event-Time"
"""Message header: the message's event time, unix seconds (decimal)."""


def headers(first_event: int, event_time: float) -> dict[str, str]:
    return {EVENT_ID: str(first_event), EVENT_TIME: repr(event_time)}


def read_headers(headers: dict[str, str] | None) -> tuple[int, float]:
    """(first event id, event time) of a message; (-1, nan) where a header is missing or malformed."""
    headers = headers or {}
    try:
        first = int(headers.get(EVENT_ID, -1))
    except ValueError:
        first = -1
    try:
        when = float(headers.get(EVENT_TIME, "nan"))
    except ValueError:
        when = float("nan")
    return first, when


def split_target(target: str) -> tuple[str, str]:
    """(server URL, subject) of `nats://HOST:PORT/SUBJECT`; ValueError naming what is wrong."""
    scheme, sep, rest = target.partition("://")
    server, slash, subject = rest.partition("/")
    host, colon, port = server.rpartition(":")
    if scheme != "nats" or not sep or not slash or not subject or not host or not colon or not port.isdigit():
        raise ValueError(f"{target!r}: expected nats://HOST:PORT/SUBJECT")
    return f"nats://{server}", subject


def partition_subject(subject: str, partition: int | None) -> str:
    """The subject of a partition (`<subject>.<partition>`); the subject itself for None (one partition)."""
    return subject if partition is None else f"{subject}.{partition}"


def partition_of(message: int, partitions: int) -> int | None:
    """The partition of a replay's `message`-th message: m mod P, None with one partition."""
    return None if partitions == 1 else message % partitions


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)
