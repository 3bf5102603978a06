"""Dynamic batching: requests that arrive together share one embedding lookup and one forward pass.

One loop takes queued requests into a micro-batch until the next would pass
`max_batch_rows`, captures `source.current()` once (so every answer of a
micro-batch comes from one model version), pools, looks the rows up, and runs
the forward pass on a dedicated compute thread while the event loop keeps
receiving requests; those form the next micro-batch (a small micro-batch runs
on the loop's thread: the hand-over would cost more than its forward pass).

Waiting: a request arriving at an idle server is answered at once, in its
own task (no hand-over to the batching loop and back). Only when
requests are arriving concurrently (the previous micro-batch merged several,
or most recent requests arrived while another was in flight) does a
micro-batch wait up to `max_delay_ms` for more, so sequential callers pay no
delay and concurrent ones get larger batches. With
batching off every request is its own micro-batch, through the same code.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from hybridrec.core.runtime import log
from hybridrec.core.config.inference import BatchingConfig
from hybridrec.core.runtime.metrics import MICRO_BATCH_ROWS, QUEUE_DELAY
from services.inference.inputs import NotFound, Samples
from services.inference.model import LoadedModel, ModelSource


@dataclass(eq=False)  # compared by identity: a field-wise == would compare the requests' arrays
class Pending:
    samples: Samples
    version: int | None  # the version the request asked for, None: any
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    queued_at: float | None = field(default_factory=time.perf_counter)
    """When it was queued; None: answered in its own task, never queued (`_answer_alone`)."""


@dataclass
class Result:
    probability: np.ndarray
    version: int
    micro_batch_rows: int


class Batcher:
    def __init__(self, source: ModelSource, batching: BatchingConfig):
        self.source = source
        self.enabled = batching.enabled
        self.max_rows = batching.max_batch_rows
        self.max_delay_s = batching.max_delay_ms / 1000.0
        self.inline_max_rows = batching.inline_max_rows
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self._held: Pending | None = None  # taken from the queue, but past a full micro-batch: goes first next
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="inference-compute")
        self.task: asyncio.Task | None = None
        self.counters = {"requests_total": 0, "rows_total": 0, "micro_batches_total": 0, "failed_requests_total": 0}
        self._concurrent = False  # did the last micro-batch merge several requests?
        self.in_flight = 0  # requests given to infer() and not yet answered
        self._overlap = 0.0  # moving average of "another request was in flight when this one arrived"
        self._running = asyncio.Lock()  # held while a micro-batch is answered: one at a time

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._loop())

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.executor.shutdown(wait=False)

    async def infer(self, samples: Samples, version: int | None = None) -> Result:
        self._overlap = 0.8 * self._overlap + 0.2 * (self.in_flight > 0)
        self.counters["requests_total"] += 1
        self.counters["rows_total"] += len(samples)
        self.in_flight += 1
        try:
            if self._alone(samples):
                await asyncio.sleep(0)  # requests that arrived with this one get as far as the queue first
                if self._alone(samples):
                    return await self._answer_alone(samples, version)
            pending = Pending(samples, version)
            self.queue.put_nowait(pending)
            return await pending.future
        finally:
            self.in_flight -= 1

    def _alone(self, samples: Samples) -> bool:
        """A request that the loop would take as a micro-batch of its own and run on the event loop's thread
        (nothing queued or running, no company expected, small): answered in the caller's task, without the
        hand-overs to the batching task and back. (Asked again after one turn of the event loop: a request that
        arrived meanwhile is in flight too, and both go to the loop, which merges them.)"""
        return (self.in_flight == 1 and self.queue.empty() and self._held is None and not self._running.locked()
                and not self._waiting() and len(samples) <= self.inline_max_rows)

    async def _answer_alone(self, samples: Samples, version: int | None) -> Result:
        async with self._running:
            self._concurrent = False
            pending = Pending(samples, version, queued_at=None)
            await self._answer([pending])
            return pending.future.result()  # raises what failed it

    def _waiting(self) -> bool:
        """Whether a micro-batch should wait for company: requests are arriving concurrently (the last
        micro-batch merged several, or requests mostly arrive while others are in flight; a sequential
        caller never has another request in flight, so it never waits)."""
        return self.enabled and (self._concurrent or self._overlap > 0.5)

    async def _take(self, batch: list[Pending]) -> None:
        """Add queued requests to `batch` (its first one taken) until the next would pass `max_rows`, or, with
        nothing queued, until the wait for company is over; a request that does not fit is held for the next."""
        rows = sum(len(p.samples) for p in batch)
        if not self.enabled:
            return
        deadline = time.monotonic() + self.max_delay_s if self._waiting() else 0.0
        while rows < self.max_rows:
            if self.queue.empty():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            else:
                nxt = self.queue.get_nowait()
            if rows + len(nxt.samples) > self.max_rows:
                self._held = nxt  # first into the next micro-batch, ahead of those queued after it
                break
            batch.append(nxt)
            rows += len(nxt.samples)

    async def _loop(self) -> None:
        while True:
            first, self._held = self._held or await self.queue.get(), None
            async with self._running:  # a request answered in its own task finishes first
                batch = [first]
                try:
                    await self._take(batch)
                    self._concurrent = len(batch) > 1 or not self.queue.empty()
                    await self._answer(batch)
                except Exception as exc:  # noqa: BLE001 - a fault of the batcher's own fails these requests,
                    # logged; the loop goes on serving (it must never end while requests wait on it)
                    log.get().error("micro_batch_failed", requests=len(batch), error=f"{type(exc).__name__}: {exc}")
                    for p in batch:
                        self._fail(p, exc)

    async def _answer(self, batch: list[Pending]) -> None:
        """Answer every request of one micro-batch (its future), all from one model version."""
        model = self.source.current()
        live = []
        for p in batch:
            if p.version is not None and p.version != model.version:
                self._fail(p, NotFound(f"model version {p.version} is not loaded; serving version "
                                       f"{model.version}"))
            else:
                live.append(p)
        if not live:
            return
        self.counters["micro_batches_total"] += 1
        started = time.perf_counter()
        for p in live:
            QUEUE_DELAY.observe(0.0 if p.queued_at is None else started - p.queued_at)
        MICRO_BATCH_ROWS.observe(sum(len(p.samples) for p in live))
        try:
            probs = await self.run(model, [p.samples for p in live])
        except Exception as exc:  # noqa: BLE001 - answered to each caller; the loop keeps serving
            for p in live:
                self._fail(p, exc)
            return
        start = 0
        rows = sum(len(p.samples) for p in live)
        for p in live:
            n = len(p.samples)
            if not p.future.done():
                p.future.set_result(Result(probs[start:start + n], model.version, rows))
            start += n

    def _fail(self, p: Pending, exc: BaseException) -> None:
        """Fail `p` with `exc`, counted once (the loop's fault handler may fail a request `_answer` failed)."""
        if not p.future.done():
            self.counters["failed_requests_total"] += 1
            p.future.set_exception(exc)

    async def run(self, model: LoadedModel, parts: list[Samples]) -> np.ndarray:
        """Probabilities of `parts` merged, by `model`: a small micro-batch on the event loop's thread, a larger
        one's forward on the compute thread."""
        samples = Samples.concat(parts)
        return await model.predict(samples, compute=None if len(samples) <= self.inline_max_rows else self._compute)

    async def _compute(self, fn, *args) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
