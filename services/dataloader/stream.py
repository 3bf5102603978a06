"""On the data loader: training samples from a NATS JetStream stream (`data.stream`) instead of files.

Each message holds one or more samples, as Criteo TSV lines or as an Arrow record batch in the training data's
own columns (its `Hybridrec-Format` header says which), with headers naming its first event's id and its event
time (hybridrec/core/layouts/event_stream.py; `hybridrec data replay` publishes a TSV or Parquet file that way). TSV
lines
are parsed by the TSV reader's kernel, Arrow batches converted by the Parquet reader's own code (columns.py):
the same hashing, `max_len` and absent values as the files. A message the config cannot read (a format it does
not know, a payload that does not decode — any error decoding it, so no message can stop the loader again and
again —, a configured column missing or of the wrong type) is counted, copied to the dead-letter subject
(`data.stream.dead_letter`, the reason in a header) and acknowledged with the rest, or with `data.bad_lines:
error` stops the run naming the subject, the message and the column. A row with a NaN or infinite dense
value follows `data.non_finite` as in a file. The loader reads the stream through a durable pull consumer and
turns it into the same training batches as a file, each with the position right after it, so resuming,
checkpoints and the hand-over to a restarted loader work as they do for files (services/dataloader/resume.py):

    Position(epoch=0, file=0, offset=S, line=L + 1)
        every message up to stream sequence S is in earlier batches, and so are the first L samples of the
        message at sequence S + 1 (L = 0 when the batch ends at a message's end)

Exactly once into training: a message is acknowledged only once every sample in it has been trained (the NN
workers' `Consumed` replies say so; the consumer acknowledges "all up to", so one acknowledgement covers every
earlier message). A (re)started loader does not wait for the broker to redeliver what its predecessor held
unacknowledged: it re-creates the durable consumer at the position the NN workers (or the newest checkpoint)
give, and the batches they hold are read but not sent, as with files. A job with no position of its own
starts after the last message the durable consumer had acknowledged, so a new job goes on where the last
stopped. Training ends after the message holding event `data.stream.until_event` - 1 (whole; or before the
first message past it), after `for_s` seconds, or on SIGUSR1 (`hybridrec run`'s first Ctrl-C): then with
what was read, evaluated and checkpointed as at any end.

With several data loaders the subject is partitioned (hybridrec/core/layouts/event_stream.py: `hybridrec data replay
--partitions L`): loader l consumes `<subject>.<l>` through a durable consumer of its own (`<durable>-<l>`; one
subject filter per consumer, as nats-server 2.9 allows), and all of the above holds per partition: its
positions, acknowledgements, restart and account (`stream-<l>.json`). `until_event` stays one event id for the
job: a partition ends at its first message whose first event is at or past it, or that holds event
`until_event - 1` — or at the replay's end marker (a message without lines, whose event id is the replay's
end), which is how a partition whose last data message ends before `until_event` learns that no more will
come to it. A marker that ends a partition is acknowledged once every batch before it is trained; one that
does not (an earlier replay's) is passed over.

`StreamSource` is all of it as the loader's `TrainingSource` (sources.py): the consumer, its account, and what
ends a stream's training.

nats-py is asyncio; the loader's reader runs on a thread of its own (the event loop serves RPCs), so the
consumer runs on another thread with its own event loop, and hands messages over through a bounded queue.
"""
from __future__ import annotations

import asyncio
import json
import math
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, Protocol

import numpy as np
import uvloop

from hybridrec.core.runtime import log
from hybridrec.core.config import Config, ConfigError, StreamConfig
from hybridrec.core.layouts.criteo_format import feature_columns
from hybridrec.core.layouts.event_stream import (ARROW, FORMAT, TSV, EventFormatError, decode_arrow, events_in,
                                    partition_subject,
                                    read_format, read_headers, subject_matches)
from hybridrec.core.layouts.event_stream import DEAD_REASON, DEAD_SEQ, DEAD_SUBJECT
from hybridrec.core.layouts.summary import StreamSummary, lag_bucket, lag_of
from services.dataloader.batching import Position, ReadCounters, Rows
from services.dataloader.tsv import BadLinePolicy, CriteoFormatError, parse_lines

DEAD_LETTER_BYTES = 1 << 30
"""The dead-letter stream the loader creates keeps at most this much, dropping its oldest copies."""
ACK_WAIT_S = 3600.0
"""The consumer redelivers an unacknowledged message after this long: never, in practice, to a live loader
(a restarted one re-creates the consumer at its position instead)."""
QUEUE_MESSAGES = 1024
"""Messages fetched ahead of the batcher."""


@dataclass
class Message:
    seq: int
    """Stream sequence."""
    data: bytes
    first_event: int
    event_time: float
    format: str = TSV
    """The payload's format (hybridrec/core/layouts/event_stream.py): tsv or arrow, or whatever an unknown header
    named."""
    headers: dict[str, str] | None = None
    """Its headers as they came (a dead letter carries them on)."""


class StreamError(RuntimeError):
    """The broker cannot be used as configured (unreachable past the retry budget, a stream that is gone)."""


def partition(loader: int, loaders: int) -> int | None:
    """The partition of the subject data loader `loader` consumes: its own index with several loaders, None
    (the subject itself) with one."""
    return loader if loaders > 1 else None


class EventSource(Protocol):
    """Where a stream's events come from, as the batcher and the account use it. `NatsSource` is NATS
    JetStream's; another broker's (Kafka: a consumer group's committed offsets in place of acknowledgements)
    implements the same calls."""

    subject: str
    """The subject (partition) it reads, for messages."""
    dead_letter_subject: str
    """Where messages it cannot read are copied (`dead_letter`)."""
    first_seq: int
    """The first sequence (offset) this job read."""
    acknowledged: int
    """The last sequence acknowledged (asked for): everything up to it was trained."""

    ended: bool
    """Set by `start`: the position is past `until_event` (a job started again after it read its last event),
    so there is nothing to read, and the consumer is left as the job left it."""

    def start(self, position: Position) -> int: ...
    def get(self, timeout: float) -> Message | None: ...
    def ack_through(self, seq: int) -> None: ...
    def finish(self, timeout_s: float) -> bool: ...
    def acknowledge_read(self, through: int, timeout_s: float) -> None: ...
    def dead_letter(self, msg: Message, reason: str) -> None: ...
    def close(self) -> None: ...


class NatsSource:
    """The durable pull consumer of `data.stream`, on a thread of its own: `start` it at a position, `get`
    messages in stream order, and `ack_through` a sequence once everything up to it has been trained."""

    def __init__(self, config: StreamConfig, url: str, *, retry_s: float, partition: int | None = None):
        self.config, self.url, self.retry_s = config, url, retry_s
        self.subject = partition_subject(config.subject, partition)
        self.durable = config.durable if partition is None else f"{config.durable}-{partition}"
        self.dead_letter_subject = config.dead_letter_subject()
        self.messages: queue.Queue[Message | BaseException] = queue.Queue(QUEUE_MESSAGES)
        self._loop = uvloop.new_event_loop()  # as every service's own loop: a fraction of asyncio's cost a message
        self._thread = threading.Thread(target=self._loop.run_forever, name="stream", daemon=True)
        self._thread.start()
        self._pending: dict[int, Any] = {}  # stream seq -> its nats message, until acknowledged
        self._acked = self._ack_asked = 0
        self._last_ack = None  # the nats message of the newest acknowledgement
        self._fetching: asyncio.Future | None = None
        self._nc = self._js = self._sub = None
        self.log = log.get()
        self.first_seq = 0
        self.ended = False
        self._dead_ready = False  # a stream holds the dead-letter subject

    def start(self, position: Position) -> int:
        """Connect, check the stream, and read from `position` (the start of the data: after the durable
        consumer's last acknowledgement). Returns the first stream sequence read; ConfigError for a stream or
        subject that is not there, StreamError for a broker that does not answer within `retry_s`."""
        self.first_seq = asyncio.run_coroutine_threadsafe(self._start(position), self._loop).result()
        if not self.ended:
            self._fetching = asyncio.run_coroutine_threadsafe(self._fetch_forever(), self._loop)
        return self.first_seq

    def get(self, timeout: float) -> Message | None:
        """The next message, or None when none came within `timeout`; the consumer's failure is raised here."""
        try:
            item = self.messages.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def ack_through(self, seq: int) -> None:
        """Acknowledge every message up to stream sequence `seq` (thread-safe; at most one request)."""
        if seq > self._acked:
            self._ack_asked = max(self._ack_asked, seq)
            self._loop.call_soon_threadsafe(self._ack, seq)

    @property
    def acknowledged(self) -> int:
        return max(self._ack_asked, 0)

    def finish(self, timeout_s: float) -> bool:
        """Make sure the broker holds the last acknowledgement before the loader exits (it covers every earlier
        message), waiting up to `timeout_s` for a broker that is restarting; False if it never answered (the
        next job then reads those messages again: nothing is skipped)."""
        return asyncio.run_coroutine_threadsafe(self._confirm_last_ack(timeout_s), self._loop).result()

    def acknowledge_read(self, through: int, timeout_s: float) -> None:
        """Acknowledge every message up to `through` that a predecessor read and the ranks trained but that was
        left unacknowledged: read them again from the consumer's floor, acknowledge, and wait until the broker
        holds it (`finish`)."""
        first = self.start(Position())
        if first > through:
            return
        deadline = time.monotonic() + timeout_s
        while (msg := self.get(timeout=1.0)) is None or msg.seq < through:
            if time.monotonic() > deadline:
                raise StreamError(f"stream {self.config.stream!r}: message {through}, trained, was not delivered "
                                  f"again within {timeout_s:.0f} s to be acknowledged")
        self.ack_through(through)
        self.finish(timeout_s)

    def dead_letter(self, msg: Message, reason: str) -> None:
        """Copy `msg` to the dead-letter subject with `reason` in a header, and wait until the broker holds it
        (before the message can be acknowledged). Published with a message id of the stream and sequence, so a
        restarted loader reading the message again within the broker's duplicate window adds no second copy.
        StreamError when the broker does not take it within `retry_s`."""
        asyncio.run_coroutine_threadsafe(self._dead_letter(msg, reason), self._loop).result()

    def close(self) -> None:
        if self._fetching is not None:
            self._fetching.cancel()
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing a connection that broke
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # -- on the consumer's thread ----------------------------------------------------------------
    async def _connect(self):
        """Connect, retrying with backoff for `retry_s` and saying so, then fail naming the key and the URL.

        nats-py's own first connect never gives up when reconnecting is allowed (which a broker restart
        mid-run needs), so the loop below first waits for the broker's port to accept a connection, and the
        connect itself is bounded by what is left of `retry_s`."""
        import nats

        deadline, delay, attempt = time.monotonic() + self.retry_s, 0.1, 0
        host, _, port = self.url.partition("://")[2].rpartition(":")
        while True:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout=2)
                writer.close()
                return await asyncio.wait_for(nats.connect(
                    self.url, connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                    allow_reconnect=True, error_cb=self._on_error, disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected), timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - refused, unresolvable, timed out: nothing answers yet
                attempt += 1
                if time.monotonic() + delay > deadline:
                    raise StreamError(f"data.stream.url: no NATS broker answers at {self.url} "
                                      f"({type(exc).__name__}: {exc}) after {self.retry_s:.0f} s "
                                      f"(cluster.retry_s)") from None
                if attempt == 1 or attempt % 20 == 0:
                    self.log.warning("stream_unreachable", url=self.url, error=f"{type(exc).__name__}: {exc}",
                                     retrying_for_s=round(deadline - time.monotonic()))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _on_error(self, exc: Exception) -> None:  # nats-py's own would print to stderr
        self.log.warning("stream_broker_error", error=f"{type(exc).__name__}: {exc}")

    async def _on_disconnected(self) -> None:
        self.log.warning("stream_broker_disconnected", url=self.url, why="reconnecting every 0.5 s")

    async def _on_reconnected(self) -> None:
        self.log.info("stream_broker_reconnected", url=self.url)

    async def _events_end(self, seq: int) -> int | None:
        """The id after the last event of message `seq` (its first event's id plus its lines); None when the
        stream no longer holds it or it carries no event id."""
        try:
            msg = await self._js.get_msg(self.config.stream, seq)
        except Exception:  # noqa: BLE001 - not found (the stream's limits dropped it): unknown
            return None
        first, _ = read_headers(msg.headers)
        if first < 0:
            return None
        try:
            return first + events_in(read_format(msg.headers), msg.data or b"")
        except EventFormatError:  # a bad message: its events cannot be counted
            return None

    async def _start(self, position: Position) -> int:
        from nats.js import api
        from nats.js.errors import NotFoundError

        c = self.config
        self._nc = await self._connect()
        self._js = self._nc.jetstream()
        try:
            info = await self._js.stream_info(c.stream)
        except NotFoundError:
            raise ConfigError(f"data.stream.stream: there is no stream {c.stream!r} on {self.url} (create it, e.g. "
                              f"with `hybridrec data replay`, or name the stream that holds "
                              f"{c.subject!r})") from None
        if not any(subject_matches(pattern, self.subject) for pattern in info.config.subjects or []):
            partitioned = "" if self.subject == c.subject else (
                " (with several data loaders, loader l reads partition <subject>.<l>: replay with --partitions "
                "set to the number of loaders)")
            raise ConfigError(f"data.stream.subject: stream {c.stream!r} on {self.url} does not hold subject "
                              f"{self.subject!r}{partitioned} (its subjects: "
                              f"{', '.join(info.config.subjects or [])})")
        if position != Position():
            first = position.offset + 1
            if c.until_event is not None and position.line == 1 and position.offset > 0 and (
                    end := await self._events_end(position.offset)) is not None and end >= c.until_event:
                # Started again after it read its last event: nothing to read. The consumer stays as it is (a
                # new one would have no acknowledgement floor, and the next job would read from the start).
                self.ended = True
                self.log.info("stream_already_read", seq=position.offset, until_event=c.until_event)
                return first
        else:  # a job with nothing of its own: after what the durable consumer acknowledged last
            try:
                first = (await self._js.consumer_info(c.stream, self.durable)).ack_floor.stream_seq + 1
            except NotFoundError:
                first = 1
        try:
            await self._js.delete_consumer(c.stream, self.durable)
        except NotFoundError:
            pass
        config = api.ConsumerConfig(durable_name=self.durable, ack_policy=api.AckPolicy.ALL,
                                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first,
                                    ack_wait=ACK_WAIT_S, filter_subject=self.subject, max_ack_pending=-1)
        self._sub = await self._js.pull_subscribe(self.subject, durable=self.durable, stream=c.stream, config=config)
        self._acked = self._ack_asked = first - 1
        self.log.info("stream_reading", url=self.url, stream=c.stream, subject=self.subject, durable=self.durable,
                      first_seq=first, last_seq=info.state.last_seq)
        return first

    async def _fetch_forever(self) -> None:
        last, loop = self.first_seq - 1, asyncio.get_running_loop()
        try:
            while True:
                try:
                    msgs = await self._sub.fetch(self.config.fetch, timeout=self.config.linger_s)
                except asyncio.TimeoutError:
                    continue
                except Exception as exc:  # noqa: BLE001 - a broker restarting: nats-py reconnects, we ask again
                    self.log.warning("stream_fetch_failed", error=f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.5)
                    continue
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq <= last:  # a redelivery of what this consumer gave already (a restarted broker):
                        if seq in self._pending:  # not passed on twice, but acknowledged through this delivery,
                            self._pending[seq] = msg  # which the broker knows (it may have lost the first)
                        continue
                    last = seq
                    self._pending[seq] = msg
                    item = _message(msg, seq)
                    try:  # the batcher keeps up: no thread hop per message
                        self.messages.put_nowait(item)
                    except queue.Full:  # it is behind: wait for room without blocking the loop
                        await loop.run_in_executor(None, self.messages.put, item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the batcher, which raises it
            self.messages.put(exc)

    def _ack(self, seq: int) -> None:
        done = [s for s in self._pending if s <= seq]
        if not done or seq <= self._acked:
            return
        newest = max(done)
        msg = self._pending[newest]
        for s in done:
            del self._pending[s]
        self._acked, self._last_ack = newest, msg
        asyncio.ensure_future(_ack(msg, newest, self.log))

    async def _confirm_last_ack(self, timeout_s: float) -> bool:
        """The last acknowledgement again, as a request the broker answers: an acknowledgement published while
        the broker was restarting may be lost with it."""
        if self._last_ack is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._nc.request(self._last_ack.reply, b"+ACK", timeout=2)
                return True
            except Exception as exc:  # noqa: BLE001 - not connected yet, or no answer: try again
                if time.monotonic() > deadline:
                    self.log.warning("stream_last_ack_unconfirmed", seq=self._acked, error=f"{type(exc).__name__}: "
                                     f"{exc}", why="the next job reads the unacknowledged messages again")
                    return False
                await asyncio.sleep(0.5)

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        subject = self.dead_letter_subject
        kept = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}  # the broker's own
        headers = {**kept, DEAD_REASON: " ".join(reason.split())[:2000], DEAD_SUBJECT: self.subject,
                   DEAD_SEQ: str(msg.seq), "Nats-Msg-Id": f"{self.config.stream}:{msg.seq}"}
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                if not self._dead_ready:
                    await self._dead_letter_stream(subject)
                await self._js.publish(subject, msg.data, headers=headers, timeout=5)
                self.log.warning("stream_message_dead_lettered", seq=msg.seq, dead_letter=subject)
                return
            except Exception as exc:  # noqa: BLE001 - a broker restarting: try again until retry_s
                if time.monotonic() > deadline:
                    raise StreamError(f"data.stream.dead_letter: message {msg.seq} could not be copied to "
                                      f"{subject!r} ({type(exc).__name__}: {exc}) within {self.retry_s:.0f} s "
                                      f"(cluster.retry_s)") from None
                await asyncio.sleep(0.5)

    async def _dead_letter_stream(self, subject: str) -> None:
        """Make sure a stream holds the dead-letter subject: the one that does (the events' own, when it holds
        `<subject>.*`), or `<stream>_DEAD`, created like the events' stream, at most 1 GiB, oldest dropped."""
        from nats.js import api
        from nats.js.errors import NotFoundError

        try:
            await self._js.find_stream_name_by_subject(subject)
        except NotFoundError:
            info = await self._js.stream_info(self.config.stream)
            await self._js.add_stream(api.StreamConfig(
                name=f"{self.config.stream}_DEAD", subjects=[subject], storage=info.config.storage,
                max_bytes=DEAD_LETTER_BYTES, discard=api.DiscardPolicy.OLD, duplicate_window=3600.0))
            self.log.info("stream_dead_letter_created", stream=f"{self.config.stream}_DEAD", subject=subject)
        self._dead_ready = True

    async def _close(self) -> None:
        if self._nc is not None:
            await self._nc.drain() if self._nc.is_connected else await self._nc.close()


class StreamAccount:
    """What the loader read from a stream and what of it is trained: each batch's events, acknowledgements
    through the source, the training lag, and `<output.dir>/stream.json` (`summary.StreamSummary`, with the
    state a successor needs).

    **The whole job across loader restarts.** The file holds, beside the summary, every batch read and not yet
    known trained (its position and its messages' event times and samples), written before the batch is sent
    (`note_batch`), and the job's id. A restarted loader of the same job goes on with it (`inherit`): the events
    counted, the lag histogram, the skipped messages; of the batches its predecessor had read and not seen
    trained, those up to where it resumes are held by the ranks, so they count as trained at its first trained
    batch (their lag measured then: it errs long by the restart for those already trained); those after it
    are read again, and cut where the predecessor cut them (`cuts`), so that every batch a rank holds from the
    predecessor is the very batch the new loader reads under the same index — a batch cut short by `linger_s`
    while the stream paused included."""

    def __init__(self, source: EventSource, output_dir: str | None = None, partition: int | None = None,
                 job: str | None = None):
        self.source, self.output_dir, self.partition, self.job = source, output_dir, partition, job
        self.end_marker: int | None = None
        """The stream sequence of the end marker that ended this partition (acknowledged once all is trained)."""
        self.read_through = 0
        """The last stream sequence the batcher consumed when training ended (acknowledged once all is trained:
        a last message skipped as bad is in no batch)."""
        self.log = log.get()
        self.stopping = threading.Event()
        """Set to end training with what was read (the loader's SIGUSR1: `hybridrec run`'s first Ctrl-C)."""
        self._lock = threading.Lock()  # the batcher's thread notes batches, the loader's loop their training
        self._batches: dict[Position, list[tuple[float, int]]] = {}  # position -> (event time, samples) per message
        self._held: list[tuple[Position, list[tuple[float, int]]]] = []  # a predecessor's, held by the ranks
        self._cuts: deque[Position] = deque()  # a predecessor's batch ends still to read again
        self._histogram: dict[int, int] = {}  # lag bucket -> samples (summary.lag_bucket)
        self._lag_range: list[float] = [math.inf, -math.inf]
        self._events = 0
        self._skipped: dict[int, int | None] = {}  # stream seq of a message skipped whole -> its events (None: unknown)
        self._first_seq: int | None = None  # the job's, when a predecessor read before this loader
        self._acknowledged = 0  # the predecessor's
        self._restarts = 0
        self._written = 0.0

    # -- a predecessor's account -------------------------------------------------------------------------
    def inherit(self, resume: Position | None) -> None:
        """Go on with the account a predecessor of this job left in `output.dir`, this loader resuming after
        `resume` (None: the ranks have trained every batch; nothing when there is no account, or it is another
        job's, or the job has no `checkpoint.job_id`, which `hybridrec run` always sets: without one, an earlier
        job's file cannot be told from this job's)."""
        if not self.output_dir or self.job is None:
            return
        try:
            state = json.loads(StreamSummary.path(self.output_dir, self.partition).read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.log.warning("stream_account_unreadable", error=str(exc), why="the account starts afresh")
            return
        if state.get("job") != self.job:
            return
        read = sorted([Position(*p), [tuple(part) for part in parts]] for p, parts in state.get("pending", []))
        cuts = sorted({p for p, _ in read} | {Position(*p) for p in state.get("cuts", [])})
        with self._lock:
            self._events = int(state.get("events", 0))
            self._histogram = {int(b): int(n) for b, n in state.get("lag_histogram") or []}
            if state.get("lag_min_s") is not None and state.get("training_lag_s"):
                self._lag_range = [float(state["lag_min_s"]), float(state["training_lag_s"]["max"])]
            self._skipped = {int(seq): n for seq, n in state.get("skipped", [])}
            self._first_seq = int(state.get("first_seq", 0)) or None
            self._acknowledged = int(state.get("acknowledged_through", 0))
            self._restarts = int(state.get("loader_restarts", 0)) + 1
            self._held = [(p, parts) for p, parts in read if resume is None or p <= resume]
            self._cuts = deque(p for p in cuts if resume is not None and p > resume)
        self.log.info("stream_account_continued", events=self._events, held_batches=len(self._held),
                      held_events=sum(n for _, parts in self._held for _, n in parts), cuts=len(self._cuts),
                      restarts=self._restarts, resume=resume.as_list() if resume is not None else "all trained")
        self.write_summary()

    def next_cut(self, position: Position) -> Position | None:
        """The next end of a predecessor's batch after `position` (passing those before it), or None."""
        with self._lock:
            while self._cuts and self._cuts[0] <= position:
                self._cuts.popleft()
            return self._cuts[0] if self._cuts else None

    def cut_at(self, position: Position) -> bool:
        """Whether a predecessor's batch ended at `position` (passing its ends before it)."""
        with self._lock:
            while self._cuts and self._cuts[0] < position:
                self._cuts.popleft()
            return bool(self._cuts) and self._cuts[0] == position

    @property
    def cutting(self) -> bool:
        """A predecessor's batch ends are still to be read again."""
        return bool(self._cuts)

    def settle_held(self) -> int:
        """Count the predecessor's batches the ranks held when this loader started as trained (they are, once
        a later batch is). Returns the stream sequence through which their messages are whole in them (0:
        none held)."""
        if not self._held:
            return 0
        now = time.time()
        with self._lock:
            through = max(p.offset for p, _ in self._held)
            for _, parts in self._held:
                self._count(parts, now)
            self._held = []
        return through

    def settle_finished(self, retry_s: float) -> None:
        """The loader restarted after every rank had trained all it was sent: its predecessor's batches are
        counted, and their messages acknowledged if it died before it could (else the next job of this consumer
        would read them again)."""
        self.inherit(None)
        through = self.settle_held()
        if through > self._acknowledged:
            self.source.acknowledge_read(through, retry_s)
        self.write_summary()

    # -- this loader's batches -----------------------------------------------------------------------------
    def note_batch(self, position: Position, parts: list[tuple[float, int, int]]) -> None:
        """The batch ending at `position` holds `parts`: (event time, samples, first event id) of each message's
        share of it. Logged (`stream_batch`: [first id, samples, event time] per share): the events of every
        batch read, in order, to account for them by id and to time them into a served version. Written to the
        account's file before the batch is sent: a successor cuts its batches where this one did."""
        with self._lock:
            self._batches[position] = [(when, samples) for when, samples, _ in parts]
        self.log.info("stream_batch", position=position.as_list(),
                      events=[[first, n, when] for when, n, first in parts])
        self.write_summary()

    def skipped(self, msg: Message, events: int | None, reason: str) -> None:
        """Message `msg` (holding `events` events, None: unknown) was skipped whole: the config cannot read it."""
        with self._lock:
            self._skipped[msg.seq] = events
        self.log.warning("stream_message_skipped", seq=msg.seq, first_event=msg.first_event, events=events,
                         reason=reason)

    def trained(self, positions: list[Position]) -> None:
        """The batches ending at `positions` have been trained, with every earlier one: acknowledge their
        messages, count their events and their training lag."""
        self.settle_held()
        now = time.time()
        with self._lock:
            last = positions[-1]
            for position in [p for p in self._batches if p <= last]:  # a final round's pieces share one position
                self._count(self._batches.pop(position), now)
        self.source.ack_through(last.offset)
        if now - self._written >= 1.0:
            self.write_summary()

    def _count(self, parts: list[tuple[float, int]], now: float) -> None:
        for when, samples in parts:
            self._events += samples
            if when == when:  # a message without an event time has no lag
                lag = now - when
                bucket = lag_bucket(lag)
                self._histogram[bucket] = self._histogram.get(bucket, 0) + samples
                self._lag_range = [min(self._lag_range[0], lag), max(self._lag_range[1], lag)]

    def summary(self) -> StreamSummary:
        with self._lock:
            return self._summary()

    def _summary(self) -> StreamSummary:
        skipped = list(self._skipped.values())
        low, high = self._lag_range
        return StreamSummary(
            events=self._events, first_seq=min(x for x in (self.source.first_seq, self._first_seq, 1 << 62) if x),
            acknowledged_through=max(self.source.acknowledged, self._acknowledged),
            training_lag_s=lag_of(self._histogram, low, high),
            lag_histogram=sorted([b, n] for b, n in self._histogram.items()) or None,
            lag_min_s=low if self._histogram else None, loader_restarts=self._restarts,
            skipped_messages=len(skipped), skipped_events=sum(n or 0 for n in skipped), partition=self.partition,
            dead_letter=self.source.dead_letter_subject if skipped else None)

    def write_summary(self) -> None:
        """`<output.dir>/stream.json` (`stream-<partition>.json`): the summary and what a successor needs (at every
        batch read, at most once a second as batches are trained, and at the end of training)."""
        self._written = time.time()
        if not self.output_dir:
            return
        with self._lock:  # one writer at a time: the batcher's thread and the loop's both write
            try:
                self._summary().write(self.output_dir, job=self.job,
                                      pending=[[p.as_list(), parts] for p, parts in
                                               [*self._held, *sorted(self._batches.items())]],
                                      cuts=[p.as_list() for p in self._cuts],
                                      skipped=sorted([seq, n] for seq, n in self._skipped.items()))
            except OSError as exc:
                self.log.warning("stream_summary_not_written", error=str(exc))


async def _ack(msg, seq: int, logger) -> None:
    try:
        await msg.ack()
    except Exception as exc:  # noqa: BLE001 - the next acknowledgement covers this one ("all up to")
        logger.warning("stream_ack_failed", seq=seq, error=f"{type(exc).__name__}: {exc}")


def _message(msg, seq: int) -> Message:
    first, when = read_headers(msg.headers)
    return Message(seq, msg.data, first, when, (msg.headers or {}).get(FORMAT, TSV), msg.headers)


@dataclass
class Parsed:
    """A message's samples, as the batcher takes them."""

    rows: Rows
    """Its good samples."""
    events: int
    """Events (samples, good and bad) the message holds: its lines, or its record batch's rows."""
    offsets: np.ndarray | None
    """Each good sample's event offset in the message (Arrow: exact); None: in order (TSV: exact when no line
    was bad)."""
    bad: int
    truncated: int
    non_finite: int = 0
    """Samples skipped for a NaN or infinite dense value (`data.non_finite: skip`)."""


class BadMessage(ValueError):
    """A message the config cannot read: a format the loader does not know, a payload that does not decode (any
    error decoding it), a configured column missing or of the wrong type; or, with `stops`, a row refused by a
    policy set to `error` (a bad line or label, a value that is not finite). Its text names the subject, the
    message and the column."""

    def __init__(self, message: str, stops: bool = False):
        super().__init__(message)
        self.stops = stops
        """The run stops on it whatever `data.bad_lines` says: a row-level refusal under an `error` policy."""


class MessageReader:
    """Turns a message into `Parsed` by its format: TSV lines through the TSV reader's kernel (Criteo columns
    only), an Arrow record batch through the Parquet reader's conversion (columns.py), for `config`'s features,
    labels and dense columns. pyarrow is imported with the first Arrow message."""

    def __init__(self, config: Config, subject: str):
        self.config, self.subject = config, subject
        self.policy = BadLinePolicy(config.data.bad_lines)
        self.non_finite = BadLinePolicy(config.data.non_finite)
        stream = config.data.stream
        self.max_bytes = stream.max_message_bytes if stream is not None else StreamConfig().max_message_bytes
        self._tsv: tuple[np.ndarray, list[int]] | str | None = None  # (columns, groups), or why TSV is unreadable
        self._spec = None

    def where(self, msg: Message) -> str:
        return f"subject {self.subject}, message {msg.seq}"

    def read(self, msg: Message) -> Parsed:
        """BadMessage for a message it cannot read as configured — whatever fails in decoding it, a MemoryError
        included: a message is data, and no data may stop the loader again and again — (with `data.bad_lines:
        error`, also for a bad line or row, which is skipped and counted otherwise)."""
        where = self.where(msg)
        try:
            if msg.format == ARROW:
                return self._arrow(msg, where)
            if msg.format != TSV:
                raise BadMessage(f"{where}: header {FORMAT} is {msg.format!r}, not a format of the event stream "
                                 f"({TSV} or {ARROW})")
            return self._lines(msg, where)
        except BadMessage:
            raise
        except Exception as exc:  # noqa: BLE001 - see the docstring: counted, dead-lettered, acknowledged
            raise BadMessage(f"{where}: the message does not decode ({type(exc).__name__}: {exc})") from None

    def _lines(self, msg: Message, where: str) -> Parsed:
        if self._tsv is None:
            try:
                self._tsv = feature_columns(self.config.features)
            except ValueError as exc:
                self._tsv = (f"the config's features are not Criteo columns ({exc}); publish the training data's "
                             f"columns as Arrow record batches (hybridrec data replay FILE.parquet)")
        if isinstance(self._tsv, str):
            raise BadMessage(f"{where}: a TSV message, but {self._tsv}")
        columns, groups = self._tsv
        try:
            chunk = parse_lines(msg.data, where=where, groups=groups, bad_lines=self.policy, non_finite=self.non_finite)
        except CriteoFormatError as exc:  # data.bad_lines or data.non_finite: error
            raise BadMessage(str(exc), stops=True) from None
        return Parsed(Rows.of_chunk(chunk, columns), chunk.end_line - 1, None, chunk.num_bad_lines, 0,
                      chunk.num_nonfinite)

    def _arrow(self, msg: Message, where: str) -> Parsed:
        from services.dataloader import columns  # pyarrow: imported where Arrow is read (see sources.eval_rows)

        if self._spec is None:
            self._spec = columns.ColumnSpec.from_config(self.config)
        try:
            table = decode_arrow(msg.data, self.max_bytes)
            columns.check_names(table.column_names, self._spec, where)
            got = columns.convert(table, self._spec, where, 0, 0, self.policy, self.non_finite)
        except EventFormatError as exc:
            raise BadMessage(f"{where}: {exc}") from None
        except columns.RowError as exc:  # data.bad_lines or data.non_finite: error
            raise BadMessage(str(exc), stops=True) from None
        except columns.ColumnFormatError as exc:
            raise BadMessage(str(exc)) from None
        return Parsed(got.rows, table.num_rows, got.kept, got.bad, got.truncated, got.non_finite)


def _runs(offsets: np.ndarray | None, start: int, stop: int) -> list[tuple[int, int]]:
    """(first event offset, count) of the runs of consecutive events among good samples [start, stop) of a
    message (`offsets` None: in order, one run)."""
    if offsets is None:
        return [(start, stop - start)]
    part = offsets[start:stop]
    if len(part) == 0:
        return []
    breaks = np.flatnonzero(np.diff(part) != 1) + 1
    bounds = np.concatenate([[0], breaks, [len(part)]])
    return [(int(part[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def iter_train_batches(source: EventSource, account: StreamAccount, config: StreamConfig, *, start: Position,
                       batch_size: int, reader: MessageReader, counters: ReadCounters
                       ) -> Iterator[tuple[Rows, Position]]:
    """Training batches of `batch_size` samples (fewer when the stream pauses for `linger_s`), each with the
    position after it, from `start` on, until `until_event` or `for_s`. While the account has a predecessor's
    batch ends after `start` (`StreamAccount.inherit`), batches end exactly there, and do not go out early when
    the stream pauses: the ranks may hold those batches, read by the predecessor under the same indices."""
    skip = start.line - 1  # samples of the message at start.offset + 1 already trained
    if source.ended:  # a job started again after its last event
        return
    pending: list[Rows] = []
    parts: list[tuple[float, int, int]] = []  # (event time, samples, first event id) per run of events in the batch
    held, position = 0, start

    def batch() -> tuple[Rows, Position]:
        account.note_batch(position, list(parts))
        parts.clear()
        return Rows.concat(pending), position

    deadline = time.monotonic() + config.for_s if config.for_s else None
    while (deadline is None or time.monotonic() < deadline) and not account.stopping.is_set():
        wait = config.linger_s if deadline is None else max(0.0, min(config.linger_s, deadline - time.monotonic()))
        msg = source.get(wait)
        if msg is None:  # the stream paused: what is held goes out now (unless a predecessor cut it later)
            if held and not account.cutting:
                yield batch()
                pending, held = [], 0
            continue
        if config.until_event is not None and msg.first_event >= config.until_event:
            if not msg.data:  # a replay's end marker past the end: this partition has nothing more
                account.end_marker = msg.seq
            break
        if not msg.data:  # an end marker before the end (an earlier replay's): passed over
            position = Position(0, 0, msg.seq, 1)
            if held and account.cutting and account.cut_at(position):
                yield batch()
                pending, held = [], 0
            continue
        try:
            parsed = reader.read(msg)
        except BadMessage as exc:
            if exc.stops or reader.policy is BadLinePolicy.ERROR:
                raise
            counters.bad_messages += 1
            try:
                events = events_in(msg.format, msg.data, reader.max_bytes) if msg.format in (TSV, ARROW) else None
            except Exception:  # noqa: BLE001 - a payload that does not decode: its events cannot be counted
                events = None
            source.dead_letter(msg, str(exc))
            account.skipped(msg, events, str(exc))
            position = Position(0, 0, msg.seq, 1)
            if held and account.cutting and account.cut_at(position):
                yield batch()
                pending, held = [], 0
            if config.until_event is not None and events is not None and msg.first_event + events >= config.until_event:
                break  # it held event until_event - 1
            continue
        counters.bad_lines += parsed.bad
        counters.rows += len(parsed.rows)
        counters.truncated_rows += parsed.truncated
        counters.count_nonfinite(source.subject, parsed.non_finite)
        rows = parsed.rows
        done = 0
        if msg.seq == start.offset + 1 and skip:
            done, skip = min(skip, len(rows)), 0
        while done < len(rows):
            end = len(rows)
            if account.cutting and (cut := account.next_cut(position)) is not None and cut.offset == msg.seq - 1:
                end = max(min(end, cut.line - 1), done + 1)  # the predecessor's batch ended inside this message
            take = min(batch_size - held, end - done)
            pending.append(rows.slice(done, done + take))
            parts += [(msg.event_time, n, msg.first_event + first) for first, n in _runs(parsed.offsets, done,
                                                                                           done + take)]
            held, done = held + take, done + take
            position = Position(0, 0, msg.seq, 1) if done == len(rows) else Position(0, 0, msg.seq - 1, done + 1)
            if held == batch_size or (account.cutting and account.cut_at(position)):
                yield batch()
                pending, held = [], 0
        position = Position(0, 0, msg.seq, 1)  # a message without valid samples is passed too
        if held and account.cutting and account.cut_at(position):  # a predecessor's batch ended after it
            yield batch()
            pending, held = [], 0
        if config.until_event is not None and msg.first_event + parsed.events >= config.until_event:
            break  # it held event until_event - 1: the last message trained
    account.read_through = position.offset  # acknowledged once all is trained: a skipped last message too
    if held:
        yield batch()


class StreamSource:
    """`data.stream` as the data loader's `TrainingSource` (sources.py): partition `partition(loader, loaders)` of
    the subject through a `NatsSource` and its `StreamAccount`. Why one object: the consumer, its account and what
    ends a stream's training (acknowledging what is trained, settling a predecessor's account, SIGUSR1) belong
    together, so the loader's server sends a stream's batches exactly as a file's. Constructing it starts the
    consumer's thread, not a connection (`open` connects); `events` replaces the NATS consumer (another broker's,
    or a test's list of messages)."""

    kind = "stream"
    waits_after_evaluation = False

    def __init__(self, config: Config, loader: int = 0, events: EventSource | None = None):
        stream = config.data.stream
        part = partition(loader, len(config.cluster.dataloader))
        if events is None:
            if stream.url is None:
                raise ConfigError("data.stream.url: no broker named (hybridrec run starts one when it is unset; "
                                  "hybridrec serve dataloader needs nats://HOST:PORT)")
            events = NatsSource(stream, stream.url, retry_s=config.cluster.retry_s, partition=part)
        self.config = config
        self.source = events
        self.account = StreamAccount(self.source, output_dir=config.output.dir, partition=part,
                                     job=config.checkpoint.job_id)
        self.on_trained: Callable[[list[Position]], None] | None = self.account.trained
        self.log = log.get()

    def handle_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGUSR1 (`hybridrec run`'s first Ctrl-C): training ends with the events read so far."""
        def end_stream() -> None:
            self.log.warning("stream_ending", why="SIGUSR1: training ends with the events read so far")
            self.account.stopping.set()

        loop.add_signal_handler(signal.SIGUSR1, end_stream)

    async def open(self, start: Position, executor: Executor) -> None:
        """Go on with a predecessor's account and cuts (`StreamAccount.inherit`), then start the consumer at
        `start` on `executor` (it connects: blocking)."""
        self.account.inherit(start)
        await asyncio.get_running_loop().run_in_executor(executor, self.source.start, start)

    def batches(self, start: Position, counters: ReadCounters) -> Iterator[tuple[Rows, Position]]:
        return iter_train_batches(self.source, self.account, self.config.data.stream, start=start,
                                  batch_size=self.config.training.batch_size,
                                  reader=MessageReader(self.config, self.source.subject), counters=counters)

    async def end_training(self, wait_trained: Callable[[], Awaitable[bool]]) -> None:
        """The last messages acknowledged once all is trained: before evaluation, while every rank is there to
        ask (it waits for the eval data); then the broker's hold of the last acknowledgement and the account."""
        if await wait_trained():
            self.account.settle_held()  # a predecessor's batches the ranks held: trained with the rest
            # the partition's end marker, or a last message skipped as bad: passed, once all is trained
            self.source.ack_through(max(self.account.end_marker or 0, self.account.read_through))
        await asyncio.get_running_loop().run_in_executor(None, self.source.finish, self.config.cluster.retry_s)
        self.account.write_summary()
        self.log.info("stream_trained", **self.account.summary().model_dump(exclude={"lag_histogram"}))

    async def settle_trained(self) -> None:
        """Every rank has the end of training: the predecessor's account, settled (`settle_finished`)."""
        await asyncio.get_running_loop().run_in_executor(None, self.account.settle_finished,
                                                         self.config.cluster.retry_s)

    def close(self) -> None:
        self.source.close()
