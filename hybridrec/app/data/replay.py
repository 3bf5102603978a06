"""`hybridrec data replay`: publish data files as a timed event stream on NATS JetStream, for tests, demos and
benchmarks of online training (`data.stream`).

Two kinds of file, one kind per replay (hybridrec/core/layouts/event_stream.py has the message format):

* Criteo TSV (`.gz` too): lines are read in order and published `rows_per_message` at a time as TSV messages;
* Parquet: rows are read in order, one row group at a time, and published `rows_per_message` at a time as
  Arrow record batches of the columns to publish: the configured ones (`--config`: labels, dense columns, each
  feature's column), the ones named (`--columns`), or every column of the file.

Every file is checked before anything is published: a file that is neither (a binary file that is not
Parquet, text that is not Criteo TSV lines) is refused naming it, and so is a Parquet file without a column to
publish, naming the column (and its config key). Each message has the id of its first event (the row's index
over all the files, from `first_event`) and its event time (the replay clock: when it is published) in its
headers. Messages go out on schedule for `rate` events a second (0: as fast as the broker takes them). The
stream is created when it is not there, holding the subject; a stream that exists must hold it.

With `partitions` P > 1 (one per data loader of the job: `cluster.dataloader`), message m goes to subject
`<subject>.<m mod P>` (the stream holds `<subject>.*`), and after the last message every partition gets an
end marker: a message without lines whose event id is the replay's end (hybridrec/core/layouts/event_stream.py).

A broker that restarts mid-replay loses nothing and stores nothing twice (`Publisher`): publishing is
pipelined (JetStream's asynchronous publish), the messages sent but not yet acknowledged are kept, and after a
lost connection they are sent again, in order, over a new one; each carries a `Nats-Msg-Id` unique to the
replay, so the broker keeps one copy of a message it had stored before it went down (its deduplication window,
two minutes by default, is rebuilt from its store when it restarts).
"""
from __future__ import annotations

import asyncio
import gzip
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hybridrec.core.runtime import log
from hybridrec.core.layouts.event_stream import (ARROW, TSV, encode_arrow, headers, partition_of, partition_subject,
                                    subject_matches)

PARQUET_MAGIC = b"PAR1"
CRITEO_FIELDS = 40
"""A Criteo TSV training line: the label, 13 integer and 26 categorical fields."""
SNIFF_BYTES = 1 << 16
MSG_ID = "Nats-Msg-Id"
"""JetStream's deduplication header: a message whose id the stream stored within its window is not stored again."""
IN_FLIGHT = 512
"""Messages sent and not yet acknowledged, at most."""
ACK_TIMEOUT_S = 10.0
"""A message not acknowledged within this long: the connection is taken for lost, and what is in flight is sent
again over a new one."""


class ReplayInputError(ValueError):
    """A file the replay cannot publish; the message names it (and the missing column, for Parquet)."""


@dataclass
class ReplayResult:
    events: int
    messages: int
    seconds: float
    first_event: int
    last_seq: int
    """The stream's last sequence when the replay ended."""
    format: str = TSV
    reconnects: int = 0
    """Connections lost and made again (a broker that restarted) during the replay."""


@dataclass(frozen=True)
class ReplayFiles:
    """What `check_files` found: the files, their kind (tsv or arrow: Parquet rows), and for Parquet the
    columns to publish (None: every column of the file)."""

    files: tuple[Path, ...]
    format: str
    columns: tuple[str, ...] | None = None


def check_files(files: list[Path], *, config=None, columns: list[str] | None = None) -> ReplayFiles:
    """Check every file before anything is published: ReplayInputError naming a file that is missing, neither
    Criteo TSV nor Parquet, of another kind than the first, or (Parquet) without a column to publish: of
    `config` (labels, dense columns, each feature's column; the message names the config key) or of
    `columns`."""
    kinds = []
    for path in files:
        kinds.append(_kind(path))
        if kinds[-1] != kinds[0]:
            raise ReplayInputError(f"{path}: a {_NAMES[kinds[-1]]} file, but {files[0]} is {_NAMES[kinds[0]]}: "
                                   f"replay one kind of file at a time")
    kind = kinds[0]
    if kind == TSV:
        if columns:
            raise ReplayInputError(f"--columns: {files[0]} is Criteo TSV, whose lines are published whole")
        return ReplayFiles(tuple(files), TSV)
    import pyarrow.parquet as pq

    spec = None
    if config is not None:
        from services.dataloader.columns import ColumnSpec

        spec = ColumnSpec.from_config(config)
    publish = tuple(columns) if columns else tuple(spec.columns) if spec is not None else None
    for path in files:
        names = pq.read_schema(path).names
        if spec is not None and (missing := spec.missing(names)) is not None:
            key, column = missing
            raise ReplayInputError(f"{path}: no column {column!r}, which the config reads ({key}); its columns: "
                                   f"{', '.join(names)}")
        for column in publish or ():
            if column not in names:
                raise ReplayInputError(f"{path}: no column {column!r} (--columns); its columns: {', '.join(names)}")
    return ReplayFiles(tuple(files), ARROW, publish)


_NAMES = {TSV: "Criteo TSV", ARROW: "Parquet"}


def _kind(path: Path) -> str:
    """TSV or ARROW (a Parquet file, published as Arrow record batches); ReplayInputError naming the file if it
    is neither."""
    if not path.is_file():
        raise ReplayInputError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if head.startswith(PARQUET_MAGIC):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ReplayInputError(f"{path}: starts as Parquet but is not a readable Parquet file ({exc})") from None
        return ARROW
    if head.startswith(b"\x1f\x8b"):
        try:
            with gzip.open(path, "rb") as f:
                head = f.read(SNIFF_BYTES)
        except (OSError, EOFError) as exc:
            raise ReplayInputError(f"{path}: not a readable gzip file ({exc})") from None
    why = _not_criteo(head)
    if why is not None:
        raise ReplayInputError(f"{path}: neither Criteo TSV lines nor a Parquet file ({why}); nothing was published")
    return TSV


def _not_criteo(head: bytes) -> str | None:
    """Why the start of a file is not Criteo TSV training lines, or None."""
    if not head:
        return "it is empty"
    if b"\0" in head:
        return "it holds NUL bytes: a binary file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not a character cut at the end of what was read
            return f"byte {exc.start} is not UTF-8 text"
        text = head[:exc.start].decode("utf-8")
    first = text.split("\n", 1)[0].rstrip("\r")
    fields = first.count("\t") + 1
    if fields != CRITEO_FIELDS and ("\n" in text or len(head) < SNIFF_BYTES):
        return f"its first line has {fields} tab-separated fields, not {CRITEO_FIELDS} (a label, 13 integer and " \
               f"26 categorical)"
    return None


def _lines(files: tuple[Path, ...], limit: int | None) -> Iterator[bytes]:
    n = 0
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            for line in f:
                if limit is not None and n >= limit:
                    return
                yield line if line.endswith(b"\n") else line + b"\n"
                n += 1


def _tsv_messages(files: tuple[Path, ...], rows_per_message: int, limit: int | None) -> Iterator[tuple[bytes, int]]:
    batch: list[bytes] = []
    for line in _lines(files, limit):
        batch.append(line)
        if len(batch) == rows_per_message:
            yield b"".join(batch), len(batch)
            batch = []
    if batch:
        yield b"".join(batch), len(batch)


def _arrow_messages(files: tuple[Path, ...], columns: tuple[str, ...] | None, rows_per_message: int,
                    limit: int | None) -> Iterator[tuple[bytes, int]]:
    """Record batches of `rows_per_message` rows (the last may be smaller), across row groups and files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    held: list = []
    count, left = 0, limit
    for path in files:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=rows_per_message, columns=list(columns) if columns else None):
            if left is not None:
                if left <= 0:
                    break
                batch = batch.slice(0, left)
                left -= batch.num_rows
            held.append(batch)
            count += batch.num_rows
            while count >= rows_per_message:
                table = pa.Table.from_batches(held)
                yield encode_arrow(table.slice(0, rows_per_message)), rows_per_message
                rest = table.slice(rows_per_message)
                held, count = rest.to_batches() if rest.num_rows else [], rest.num_rows
    if count:
        yield encode_arrow(pa.Table.from_batches(held)), count


def stream_subjects(subject: str, partitions: int) -> list[str]:
    """The subjects a stream holds for `partitions` partitions of `subject`."""
    return [subject] if partitions == 1 else [f"{subject}.*"]


class Publisher:
    """In-order JetStream publishing that survives a broker restart: up to IN_FLIGHT messages sent and not yet
    acknowledged, kept until they are; a lost connection (an error, or an acknowledgement overdue by
    ACK_TIMEOUT_S) is made again, for up to `retry_s` seconds, and what was in flight sent again in order, under
    the same `Nats-Msg-Id`s (the broker stores each once)."""

    def __init__(self, url: str, *, retry_s: float):
        self.url, self.retry_s = url, retry_s
        self.reconnects = 0
        self.nc = self.js = None
        self._inflight: deque[list] = deque()  # [subject, payload, headers, ack future]
        self.log = log.get()

    async def connect(self) -> None:
        import nats

        deadline, delay = time.monotonic() + self.retry_s, 0.1
        while True:
            try:
                self.nc = await nats.connect(self.url, connect_timeout=2, allow_reconnect=False,
                                             error_cb=self._quiet, disconnected_cb=self._quiet_disconnect)
                self.js = self.nc.jetstream()
                return
            except Exception as exc:  # noqa: BLE001 - refused, timed out: the broker is not (yet) there
                if time.monotonic() + delay > deadline:
                    raise ConnectionError(f"no NATS broker answers at {self.url} ({type(exc).__name__}: {exc}) "
                                          f"after {self.retry_s:.0f} s") from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)

    async def _quiet(self, exc: Exception) -> None:  # nats-py's default prints; a restart is handled here
        pass

    async def _quiet_disconnect(self) -> None:
        pass

    async def publish(self, subject: str, payload: bytes, message_headers: dict[str, str]) -> None:
        while len(self._inflight) >= IN_FLIGHT:
            await self._settle_oldest()
        entry = [subject, payload, message_headers, None]
        self._inflight.append(entry)
        try:
            entry[3] = await self.js.publish_async(subject, payload, headers=message_headers, wait_stall=ACK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the connection is gone (a broker restarting)
            await self._recover(exc)

    async def flush(self) -> None:
        """Wait until every message sent is acknowledged (sending again after a lost connection)."""
        while self._inflight:
            await self._settle_oldest()

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()

    async def _settle_oldest(self) -> None:
        import nats.js.errors

        future = self._inflight[0][3]
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=ACK_TIMEOUT_S)
        except nats.js.errors.APIError as exc:
            if exc.code != 503 and not isinstance(exc, nats.js.errors.NoStreamResponseError):
                raise
            await self._recover(exc)  # no responders: the broker's JetStream is still starting
            return
        except Exception as exc:  # noqa: BLE001 - overdue, or the connection closed: send again on a new one
            await self._recover(exc)
            return
        self._inflight.popleft()

    async def _recover(self, exc: BaseException) -> None:
        """A new connection, and every message in flight sent again over it, in order."""
        while True:
            self.reconnects += 1
            self.log.warning("replay_reconnecting", url=self.url, in_flight=len(self._inflight),
                             error=f"{type(exc).__name__}: {exc}")
            for entry in self._inflight:
                if entry[3] is not None and not entry[3].done():
                    entry[3].cancel()
            try:
                await self.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
            await asyncio.sleep(0.2)
            await self.connect()
            try:
                for entry in self._inflight:
                    entry[3] = await self.js.publish_async(entry[0], entry[1], headers=entry[2],
                                                           wait_stall=ACK_TIMEOUT_S)
                return
            except Exception as again:  # noqa: BLE001 - lost again while sending: once more
                exc = again


async def replay(files: list[Path] | ReplayFiles, *, url: str, subject: str, stream: str, rate: float,
                 rows_per_message: int, first_event: int = 0, limit: int | None = None, partitions: int = 1,
                 retry_s: float = 120.0) -> ReplayResult:
    """Publish `files` (checked first: `check_files`; a list of paths is checked as TSV or Parquet with every
    column). ConnectionError when no broker answers within `retry_s`."""
    from nats.js.errors import NotFoundError

    checked = files if isinstance(files, ReplayFiles) else check_files(list(files))
    subjects = [partition_subject(subject, partition_of(p, partitions)) for p in range(partitions)]
    publisher = Publisher(url, retry_s=retry_s)
    await publisher.connect()
    token = uuid.uuid4().hex[:16]
    try:
        js = publisher.js
        try:
            info = await js.stream_info(stream)
            held = info.config.subjects or []
            missing = [s for s in subjects
                       if not (s in held if partitions == 1 else any(subject_matches(h, s) for h in held))]
            if missing:
                raise ValueError(f"stream {stream!r} on {url} does not hold subject {missing[0]!r} (its subjects: "
                                 f"{', '.join(held)}); name another --stream")
        except NotFoundError:
            await js.add_stream(name=stream, subjects=stream_subjects(subject, partitions))
        messages_of = (_tsv_messages(checked.files, rows_per_message, limit) if checked.format == TSV
                       else _arrow_messages(checked.files, checked.columns, rows_per_message, limit))
        started, event, messages = time.monotonic(), first_event, 0
        for payload, count in messages_of:
            if rate > 0:
                delay = started + (event - first_event) / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if len(payload) > publisher.nc.max_payload:
                raise ValueError(f"message {messages} is {len(payload):,} bytes, more than the broker takes "
                                 f"({publisher.nc.max_payload:,}): lower --rows-per-message")
            await publisher.publish(subjects[messages % partitions], payload,
                                    {**headers(event, time.time(), checked.format), MSG_ID: f"{token}-{messages}"})
            event += count
            messages += 1
        if partitions > 1:  # each partition learns where the replay ends (the id after its last event)
            for p, target in enumerate(subjects):
                await publisher.publish(target, b"", {**headers(event, time.time()), MSG_ID: f"{token}-end-{p}"})
        await publisher.flush()
        seconds = time.monotonic() - started
        last = (await publisher.js.stream_info(stream)).state.last_seq
    finally:
        await publisher.close()
    return ReplayResult(event - first_event, messages, seconds, first_event, last, checked.format,
                        publisher.reconnects)


# -- the command ---------------------------------------------------------------------------------------------
class ReplayRefused(Exception):
    """What `hybridrec data replay` refuses or could not do, the message as the CLI prints it."""


@dataclass(frozen=True)
class ReplayRequest:
    """The options of `hybridrec data replay`, as given (see its --help)."""

    files: list[Path]
    to: str
    rate: float = 10_000.0
    stream: str = "HYBRIDREC_EVENTS"
    rows_per_message: int = 100
    first_event: int = 0
    limit: int | None = None
    partitions: int = 1
    config_path: Path | None = None
    overrides: list[str] | None = None
    columns: str | None = None
    retry_s: float = 120.0


def publish(request: ReplayRequest) -> str:
    """Check every file, then replay them as `request` says; the line to print. ReplayRefused naming the
    option, the file or the broker that stopped it."""
    from hybridrec.core.layouts.event_stream import split_target

    try:
        url, subject = split_target(request.to)
    except ValueError as exc:
        raise ReplayRefused(f"--to: {exc}") from None
    if request.config_path is not None and request.columns:
        raise ReplayRefused("--config and --columns: name the columns one way")
    checked = _checked_files(request)
    try:
        result = asyncio.run(replay(checked, url=url, subject=subject, stream=request.stream, rate=request.rate,
                                    rows_per_message=request.rows_per_message, first_event=request.first_event,
                                    limit=request.limit, partitions=request.partitions, retry_s=request.retry_s))
    except ValueError as exc:
        raise ReplayRefused(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a broker that is not there: nats-py raises several kinds
        raise ReplayRefused(f"--to {request.to}: {type(exc).__name__}: {exc}") from None
    return _published(result, subject, request)


def _checked_files(request: ReplayRequest) -> ReplayFiles:
    """Every file checked before anything is published, against --config's columns or --columns."""
    from hybridrec.core.config import ConfigError, load_config

    try:
        config = load_config(request.config_path, request.overrides or []) if request.config_path is not None \
            else None
    except ConfigError as exc:
        raise ReplayRefused(str(exc)) from None
    columns = [c.strip() for c in request.columns.split(",") if c.strip()] if request.columns else None
    try:
        return check_files(request.files, config=config, columns=columns)
    except ReplayInputError as exc:
        raise ReplayRefused(str(exc)) from None


def _published(result: ReplayResult, subject: str, request: ReplayRequest) -> str:
    kind = "" if result.format == "tsv" else " (Arrow record batches)"
    restarts = f"; {result.reconnects} reconnection{'s' if result.reconnects != 1 else ''}" if result.reconnects \
        else ""
    partitions = request.partitions
    return (f"published {result.events:,} events ({result.first_event}..{result.first_event + result.events - 1}) "
            f"in {result.messages:,} messages{kind} to {subject}"
            f"{f' (.0 to .{partitions - 1})' if partitions > 1 else ''} in {result.seconds:.1f} s "
            f"({result.events / max(result.seconds, 1e-9):,.0f} events/s); stream {request.stream} ends at "
            f"{result.last_seq}{restarts}")
