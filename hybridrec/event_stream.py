"""The event stream's message format, shared by its writer (`hybridrec data replay`) and its reader (the data
loader with `data.stream`, services/dataloader/stream.py).

A message on the stream's subject holds one or more samples as lines in the training data's row format
(Criteo TSV). Its headers name the id of its first event (the ids of its lines follow it) and its event
time. Event ids make every sample countable end to end: which ones were trained, and how often.
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
