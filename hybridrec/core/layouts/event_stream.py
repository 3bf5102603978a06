"""The event stream's message format, shared by its writer (`hybridrec data replay`) and its reader (the data
loader with `data.stream`, services/dataloader/stream.py).

A message on the stream's subject holds one or more samples, in one of two formats, named by its
`Hybridrec-Format` header:

* absent (or `tsv`): lines in the Criteo TSV row format, a sample each. The default: a TSV message is what it
  was before the header existed, byte for byte;
* `arrow`: an Arrow IPC stream (a schema, then one record batch) whose columns are the training data's own:
  label columns, dense columns, scalar and list (multi-hot, sequence) ID columns, as a Parquet file holds them
  (`hybridrec data replay FILE.parquet` publishes a file's rows that way). The data loader reads it with the
  Parquet reader's own code (services/dataloader/columns.py), so a row trains as it would from the file.

Its headers also name the id of its first event (the ids of its samples follow it, in order) and its event
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
FORMAT = "Hybridrec-Format"
"""Message header: the payload's format, `arrow`; absent for TSV (the default)."""
DEAD_REASON = "Hybridrec-Dead-Reason"
"""A dead letter's header (`data.stream.dead_letter`): why the data loader could not read the message."""
DEAD_SUBJECT = "Hybridrec-Dead-Subject"
"""A dead letter's header: the subject the message was read from."""
DEAD_SEQ = "Hybridrec-Dead-Seq"
"""A dead letter's header: the message's sequence in its stream."""
TSV, ARROW = "tsv", "arrow"
FORMATS = (TSV, ARROW)


class EventFormatError(ValueError):
    """A message whose payload is not in the format its header names (or names no format this reader knows)."""


def headers(first_event: int, event_time: float, format: str = TSV) -> dict[str, str]:
    """A message's headers; a TSV message has no format header (as before the header existed)."""
    out = {EVENT_ID: str(first_event), EVENT_TIME: repr(event_time)}
    if format != TSV:
        out[FORMAT] = format
    return out


def read_format(headers: dict[str, str] | None) -> str:
    """The message's format: TSV when it names none; EventFormatError for one this reader does not know."""
    format = (headers or {}).get(FORMAT, TSV)
    if format not in FORMATS:
        raise EventFormatError(f"header {FORMAT}: {format!r} is not a format of the event stream "
                               f"({', '.join(FORMATS)})")
    return format


def encode_arrow(batch) -> bytes:
    """An Arrow record batch (pyarrow.RecordBatch or Table) as a message payload: an IPC stream of its schema
    and one record batch."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        if isinstance(batch, pa.Table):
            writer.write_table(batch)
        else:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


MAX_MESSAGE_BYTES = 64 << 20
"""The default bound on what an Arrow message may take once decoded (`data.stream.max_message_bytes`)."""


def decode_arrow(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES):
    """The pyarrow.Table of an `arrow` message's payload, bounded before it is decoded and fully validated after
    (hybridrec/core/wire/arrow_ipc.py); EventFormatError when it is not an Arrow IPC stream this reader takes."""
    from hybridrec.core.wire.arrow_ipc import ArrowStreamError, read_stream

    try:
        return read_stream(data, max_bytes)
    except ArrowStreamError as exc:
        raise EventFormatError(str(exc)) from None


def events_in(format: str, data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """How many events (samples, good or bad) a message's payload holds: its lines, or its record batch's rows.
    EventFormatError for a payload that does not decode."""
    if format == ARROW:
        return decode_arrow(data, max_bytes).num_rows if data else 0
    return data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


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
