"""`hybridrec data replay`: publish data files as a timed event stream on NATS JetStream, for tests, demos and
benchmarks of online training (`data.stream`).

Lines are read in order and published `rows_per_message` at a time on the subject, each message with the id
of its first event (the line's index over all the files, from `first_event`) and its event time (the replay
clock: when it is published) in its headers (hybridrec/event_stream.py). Messages go out on schedule for
`rate` events a second (0: as fast as the broker takes them); publishing is pipelined (JetStream's
asynchronous publish, every acknowledgement awaited before the end). The stream is created when it is not
there, holding the subject; a stream that exists must hold it.

With `partitions` P > 1 (one per data loader of the job: `cluster.dataloader`), message m goes to subject
`<subject>.<m mod P>` (the stream holds `<subject>.*`), and after the last message every partition gets an
end marker: a message without lines whose event id is the replay's end (hybridrec/event_stream.py).
"""
from __future__ import annotations

import asyncio
import gzip
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hybridrec.event_stream import headers, partition_of, partition_subject, subject_matches


@dataclass
class ReplayResult:
    events: int
    messages: int
    seconds: float
    first_event: int
    last_seq: int
    """The stream's last sequence when the replay ended."""


def _lines(files: list[Path], limit: int | None) -> Iterator[bytes]:
    n = 0
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            for line in f:
                if limit is not None and n >= limit:
                    return
                yield line if line.endswith(b"\n") else line + b"\n"
                n += 1


def _messages(files: list[Path], rows_per_message: int, limit: int | None) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for line in _lines(files, limit):
        batch.append(line)
        if len(batch) == rows_per_message:
            yield batch
            batch = []
    if batch:
        yield batch


def stream_subjects(subject: str, partitions: int) -> list[str]:
    """The subjects a stream holds for `partitions` partitions of `subject`."""
    return [subject] if partitions == 1 else [f"{subject}.*"]


async def replay(files: list[Path], *, url: str, subject: str, stream: str, rate: float, rows_per_message: int,
                 first_event: int = 0, limit: int | None = None, partitions: int = 1) -> ReplayResult:
    import nats
    from nats.js.errors import NotFoundError

    subjects = [partition_subject(subject, partition_of(p, partitions)) for p in range(partitions)]
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=10)
    try:
        js = nc.jetstream()
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
        started, event, messages = time.monotonic(), first_event, 0
        for lines in _messages(files, rows_per_message, limit):
            if rate > 0:
                delay = started + (event - first_event) / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            await js.publish_async(subjects[messages % partitions], b"".join(lines),
                                   headers=headers(event, time.time()), wait_stall=30)
            event += len(lines)
            messages += 1
        if partitions > 1:  # each partition learns where the replay ends (the id after its last event)
            for target in subjects:
                await js.publish_async(target, b"", headers=headers(event, time.time()), wait_stall=30)
        await js.publish_async_completed()
        seconds = time.monotonic() - started
        last = (await js.stream_info(stream)).state.last_seq
    finally:
        await nc.close()
    return ReplayResult(event - first_event, messages, seconds, first_event, last)
