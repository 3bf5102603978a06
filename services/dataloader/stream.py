"""On the data loader: training samples from a NATS JetStream stream (`data.stream`) instead of files.

Each message holds one or more samples as Criteo TSV lines, with headers naming its first event's id and its
event time (hybridrec/event_stream.py; `hybridrec data replay` publishes a file that way). The loader reads the stream through a durable pull consumer and turns it into the same training
batches as a file, each with the position right after it, so resuming, checkpoints and the hand-over to a
restarted loader work as they do for files (services/dataloader/resume.py):

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

With several data loaders the subject is partitioned (hybridrec/event_stream.py: `hybridrec data replay
--partitions L`): loader l consumes `<subject>.<l>` through a durable consumer of its own (`<durable>-<l>`; one
subject filter per consumer, as nats-server 2.9 allows), and all of the above holds per partition: its
positions, acknowledgements, restart and account (`stream-<l>.json`). `until_event` stays one event id for the
job: a partition ends at its first message whose first event is at or past it, or that holds event
`until_event - 1` — or at the replay's end marker (a message without lines, whose event id is the replay's
end), which is how a partition whose last data message ends before `until_event` learns that no more will
come to it. A marker that ends a partition is acknowledged once every batch before it is trained; one that
does not (an earlier replay's) is passed over.

nats-py is asyncio; the loader's reader runs on a thread of its own (the event loop serves RPCs), so the
consumer runs on another thread with its own event loop, and hands messages over through a bounded queue.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import numpy as np
import uvloop

from hybridrec import log
from hybridrec.config import ConfigError, StreamConfig
from hybridrec.event_stream import partition_subject, read_headers, subject_matches
from hybridrec.summary import Lag, StreamSummary
from services.dataloader.batching import Position, ReadCounters, Rows
from services.dataloader.tsv import BadLinePolicy, parse_lines

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
    def close(self) -> None: ...


class NatsSource:
    """The durable pull consumer of `data.stream`, on a thread of its own: `start` it at a position, `get`
    messages in stream order, and `ack_through` a sequence once everything up to it has been trained."""

    def __init__(self, config: StreamConfig, url: str, *, retry_s: float, partition: int | None = None):
        self.config, self.url, self.retry_s = config, url, retry_s
        self.subject = partition_subject(config.subject, partition)
        self.durable = config.durable if partition is None else f"{config.durable}-{partition}"
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
        data = msg.data or b""
        return None if first < 0 else first + data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)

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

    async def _close(self) -> None:
        if self._nc is not None:
            await self._nc.drain() if self._nc.is_connected else await self._nc.close()


class StreamAccount:
    """What the loader read from a stream and what of it is trained: each batch's events, acknowledgements
    through the source, the training lag, and `<output.dir>/stream.json` (`summary.StreamSummary`)."""

    def __init__(self, source: EventSource, output_dir: str | None = None, partition: int | None = None):
        self.source, self.output_dir, self.partition = source, output_dir, partition
        self.end_marker: int | None = None
        """The stream sequence of the end marker that ended this partition (acknowledged once all is trained)."""
        self.log = log.get()
        self.stopping = threading.Event()
        """Set to end training with what was read (the loader's SIGUSR1: `hybridrec run`'s first Ctrl-C)."""
        self._lock = threading.Lock()  # the batcher's thread notes batches, the loader's loop their training
        self._batches: dict[Position, list[tuple[float, int]]] = {}  # position -> (event time, samples) per message
        self._lags: list[tuple[float, int]] = []  # (seconds from event time to trained, samples)
        self._events = 0
        self._written = 0.0

    def note_batch(self, position: Position, parts: list[tuple[float, int, int]]) -> None:
        """The batch ending at `position` holds `parts`: (event time, samples, first event id) of each message's
        share of it. Logged (`stream_batch`: [first id, samples, event time] per share): the events of every
        batch read, in order, to account for them by id and to time them into a served version."""
        with self._lock:
            self._batches[position] = [(when, samples) for when, samples, _ in parts]
        self.log.info("stream_batch", position=position.as_list(),
                      events=[[first, n, when] for when, n, first in parts])

    def trained(self, positions: list[Position]) -> None:
        """The batches ending at `positions` have been trained, with every earlier one: acknowledge their
        messages, count their events and their training lag."""
        now = time.time()
        with self._lock:
            for position in positions:
                for when, samples in self._batches.pop(position, ()):
                    self._events += samples
                    if when == when:  # a message without an event time has no lag
                        self._lags.append((now - when, samples))
        self.source.ack_through(positions[-1].offset)
        if now - self._written >= 1.0:
            self.write_summary()

    def summary(self) -> StreamSummary:
        with self._lock:
            lags = np.array(self._lags, np.float64).reshape(-1, 2)
            events = self._events
        lag = None
        if lags.shape[0]:
            order = np.argsort(lags[:, 0])
            seconds, weight = lags[order, 0], np.cumsum(lags[order, 1]) / lags[:, 1].sum()
            pick = lambda q: float(seconds[min(np.searchsorted(weight, q), len(seconds) - 1)])  # noqa: E731
            lag = Lag(p50=pick(0.5), p99=pick(0.99), max=float(seconds[-1]))
        return StreamSummary(events=events, first_seq=self.source.first_seq, acknowledged_through=self.source.acknowledged,
                             training_lag_s=lag, partition=self.partition)

    def write_summary(self) -> None:
        """`<output.dir>/stream.json` (`stream-<partition>.json`) (at most once a second while training, and at
        its end)."""
        self._written = time.time()
        if self.output_dir:
            try:
                self.summary().write(self.output_dir)
            except OSError as exc:
                self.log.warning("stream_summary_not_written", error=str(exc))


async def _ack(msg, seq: int, logger) -> None:
    try:
        await msg.ack()
    except Exception as exc:  # noqa: BLE001 - the next acknowledgement covers this one ("all up to")
        logger.warning("stream_ack_failed", seq=seq, error=f"{type(exc).__name__}: {exc}")


def _message(msg, seq: int) -> Message:
    first, when = read_headers(msg.headers)
    return Message(seq, msg.data, first, when)


def iter_train_batches(source: EventSource, account: StreamAccount, config: StreamConfig, *, start: Position,
                       batch_size: int,
                       columns: np.ndarray, groups: list[int], bad_lines: BadLinePolicy | str,
                       counters: ReadCounters) -> Iterator[tuple[Rows, Position]]:
    """Training batches of `batch_size` samples (fewer when the stream pauses for `linger_s`), each with the
    position after it, from `start` on, until `until_event` or `for_s`."""
    skip = start.line - 1  # samples of the message at start.offset + 1 already trained
    if source.ended:  # a job started again after its last event
        return
    pending: list[Rows] = []
    parts: list[tuple[float, int, int]] = []  # (event time, samples, first event id) per message in the batch
    held, position = 0, start

    def batch() -> tuple[Rows, Position]:
        account.note_batch(position, list(parts))
        parts.clear()
        return Rows.concat(pending), position

    deadline = time.monotonic() + config.for_s if config.for_s else None
    while (deadline is None or time.monotonic() < deadline) and not account.stopping.is_set():
        wait = config.linger_s if deadline is None else max(0.0, min(config.linger_s, deadline - time.monotonic()))
        msg = source.get(wait)
        if msg is None:  # the stream paused: what is held goes out now
            if held:
                yield batch()
                pending, held = [], 0
            continue
        if config.until_event is not None and msg.first_event >= config.until_event:
            if not msg.data:  # a replay's end marker past the end: this partition has nothing more
                account.end_marker = msg.seq
            break
        if not msg.data:  # an end marker before the end (an earlier replay's): passed over
            position = Position(0, 0, msg.seq, 1)
            continue
        chunk = parse_lines(msg.data, where=f"subject {source.subject}, message {msg.seq}", groups=groups,
                            bad_lines=bad_lines)
        counters.bad_lines += chunk.num_bad_lines
        counters.rows += len(chunk)
        rows = Rows.of_chunk(chunk, columns)
        done = 0
        if msg.seq == start.offset + 1 and skip:
            done, skip = min(skip, len(rows)), 0
        while done < len(rows):
            take = min(batch_size - held, len(rows) - done)
            pending.append(rows.slice(done, done + take))
            parts.append((msg.event_time, take, msg.first_event + done))  # exact when no line of it was bad
            held, done = held + take, done + take
            position = Position(0, 0, msg.seq, 1) if done == len(rows) else Position(0, 0, msg.seq - 1, done + 1)
            if held == batch_size:
                yield batch()
                pending, held = [], 0
        position = Position(0, 0, msg.seq, 1)  # a message without valid samples is passed too
        if config.until_event is not None and msg.first_event + chunk.end_line - 1 >= config.until_event:
            break  # it held event until_event - 1: the last message trained
    if held:
        yield batch()
