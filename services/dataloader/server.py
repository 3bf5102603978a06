"""`hybridrec serve dataloader`: read the data, split each batch, dispatch the halves.

These are steps 1–2 of docs/architecture.md#one-training-batch.

With several data loaders (`cluster.dataloader`), replica l reads its own
split of the data (splits.py; with `data.stream`, partition l of the subject)
and is a stream of its own end to end: its batches are numbered 0, 1, ... and
dealt evenly to the ranks, its checkpoint entry, restart plan and
acknowledgements are its own. The NN workers take their batches from the
loaders in an order every rank follows (services/nn_worker/inbox.py).

Parsing and batch preparation (per-feature dedup) run on a helper thread so the
event loop keeps serving RPCs. For each batch the ID half goes to an embedding
worker (round robin) which answers a batch_ref; the dense half then goes with
that batch_ref to its NN rank through a per-rank sender, so each rank receives
its batches in order while different ranks are fed concurrently. The process
exits 0 after it has sent the end of evaluation to every rank.

What it reads is one `TrainingSource` (sources.py), files or a stream, chosen
once as it starts; `serve` reads top to bottom: checks, the host, the source,
then `send_data` (the resume plan, the training data, the eval data).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import grpc

from hybridrec.core.runtime import log, rpc
from hybridrec.core.wire.frames import BatchRef, DenseBatch, EndOfPhase, Received
from hybridrec.core.config import Config, ConfigError
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime.service import ServiceHost
from hybridrec.core.layouts import checkpoints
from services.dataloader.delivery import END, Window, deliver
from services.dataloader.resume import PhaseResume, Resume, plan
from services.dataloader.batching import Position, ReadCounters, Rows, deal_evenly, iter_batches
from services.dataloader.sources import TrainingSource, check_prepared, check_splits, eval_rows as read_eval_rows
from services.dataloader.sources import training_source

_DONE = object()
IDLE_PROBE_S = 2.0
"""A rank's sender with nothing new to send asks the rank this often whether it still holds what it was sent
(a replacement of a lost rank does not, and on a quiet stream no failed call would say so)."""


class DataLoaderServicer:
    def __init__(self, replica: int):
        self.replica = replica
        self.counters = {"train_batches_total": 0, "eval_batches_total": 0, "rows_sent_total": 0,
                         "frames_resent_total": 0, "batches_held_by_ranks_total": 0}
        self.reads: list[ReadCounters] = []  # the readers' own counters, summed at scrape time

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counters.items()},
                "rows_read_total": float(sum(r.rows for r in self.reads)),
                "bad_lines_total": float(sum(r.bad_lines for r in self.reads)),
                "dropped_rows_total": float(sum(r.dropped_rows for r in self.reads)),
                "truncated_rows_total": float(sum(r.truncated_rows for r in self.reads))}

    async def Stats(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.ServiceStats:
        return pb.ServiceStats(service="dataloader", replica=self.replica,
                               values=self.stats())


class Dispatcher:
    """Sends data loader `loader`'s prepared batches to embedding workers and NN workers."""

    def __init__(self, config: Config, servicer: DataLoaderServicer, loader: int = 0):
        self.config, self.servicer, self.loader = config, servicer, loader
        self.timeout = config.cluster.rpc_timeout_s
        self.retry_s = config.cluster.retry_s
        self.ew_channels = [rpc.channel(a) for a in config.cluster.embedding_workers]
        self.nn_channels = [rpc.channel(a) for a in config.cluster.nn_workers]
        self.ew_put = [rpc.raw_method(ch, "EmbeddingWorker", "PutBatch") for ch in self.ew_channels]
        self.nn_put = [rpc.raw_method(ch, "NNWorker", "PutBatch") for ch in self.nn_channels]
        self.nn_received = [rpc.raw_method(ch, "NNWorker", "Received") for ch in self.nn_channels]
        self.next_ew = itertools.cycle(range(len(self.ew_put)))
        self.windows = [Window() for _ in self.nn_put]  # per rank, across phases
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reader")
        self.lz4 = config.training.compression.lz4_ids
        self.on_trained: Callable[[list[Position]], None] | None = None
        """Called with the positions after training batches newly known trained, in order, each with every
        earlier one (a stream acknowledges its messages through the last, and counts their lag)."""
        self._untrained: deque[tuple[int, Position]] = deque()  # training batches read, not yet known trained
        self.ended: str | None = None  # the last phase whose end this loader has delivered to every rank
        self.past_training: set[int] = set()  # ranks that said they had finished training (`Received`)

    async def wait_trained(self) -> bool:
        """Wait until every rank has finished training (it is evaluating, or done), then count every training
        batch trained (`on_trained`); False when a rank did not answer for `cluster.retry_s` (or, when longer,
        `cluster.rejoin_timeout_s`: a replacement may be joining).

        Meanwhile a rank that no longer holds the end this loader sent it (a replacement of a lost NN worker,
        which another loader's batches keep training) is sent every frame it has not confirmed again: the
        batches its predecessor still owed and the end of the phase, without which it would wait for this
        loader for ever.

        The question is `Received`, which names this loader: a rank that is done stays up until it has told
        every loader that it is past training (`past_training`), so a loader polling here cannot miss the
        moment between a rank's short evaluation and its exit, and wait for it in vain."""
        loop = asyncio.get_running_loop()
        patience = max(self.retry_s, self.config.cluster.rejoin_timeout_s)

        async def left_training(rank: int) -> bool:
            deadline = loop.time() + patience
            while rank not in self.past_training:
                try:
                    held = await self._ask_received(rank)
                    if not held.past_training and self.ended is not None and self.ended not in held.ended:
                        await self._deliver_again(rank)
                    deadline = loop.time() + patience
                except grpc.aio.AioRpcError:
                    if loop.time() > deadline:
                        return False  # not acknowledged: a later job reads those messages again, nothing is skipped
                if rank not in self.past_training:
                    await asyncio.sleep(0.2)
            return True

        if not all(await asyncio.gather(*(left_training(rank) for rank in range(len(self.windows))))):
            return False
        self.note_trained(through=[END] * len(self.windows))
        return True

    async def _deliver_again(self, rank: int) -> None:
        """Send rank `rank` (a replacement) every frame of its window it has not confirmed."""
        window = self.windows[rank]
        window.resent += window.delivered
        window.delivered = 0
        put = self.nn_put[rank]
        log.get().warning("frames_sent_again", rank=rank, frames=len(window.frames), ended=self.ended,
                          why="the rank no longer holds them (a replacement)")
        await deliver(window, lambda frame: put(frame, timeout=None), retry_s=self.retry_s)
        self.servicer.counters["frames_resent_total"] = sum(w.resent for w in self.windows)

    async def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        for ch in self.ew_channels + self.nn_channels:
            await ch.close()

    def _prepared(self, items: Iterator[tuple[int, Rows, Position | None]], phase: str):
        for rank, rows, position in items:
            sparse = rows.sparse(phase).encode(lz4=self.lz4)
            yield rank, sparse, rows, position

    async def received(self) -> list[Received]:
        """Every rank's answer to `Received`, in rank order (waiting out ranks that are still joining)."""
        async def ask(rank: int) -> Received:
            return await rpc.retry(lambda: self._ask_received(rank), deadline_s=self.retry_s)

        return list(await asyncio.gather(*(ask(rank) for rank in range(len(self.nn_received)))))

    async def _ask_received(self, rank: int) -> Received:
        """Rank `rank`'s `Received` answer for this loader, noting a rank past training: once it has told every
        loader so, a rank that is done exits, and would not answer a later question."""
        held = Received.decode(await self.nn_received[rank](Received(loader=self.loader).encode(),
                                                            timeout=self.timeout))
        if held.past_training:
            self.past_training.add(rank)
        return held

    async def run_phase(self, phase: str, items: Iterator[tuple[int, Rows, Position | None]], end_meta,
                        resume: PhaseResume = PhaseResume()) -> int:
        """Stream one phase from batch `resume.first_seq` on, leaving out what each rank holds already;
        returns the number of batches sent."""
        loop = asyncio.get_running_loop()
        prepared = self._prepared(items, phase)
        queues = [asyncio.Queue(maxsize=2) for _ in self.nn_put]
        # samples of this phase sent to each rank so far (by this loader or, before a restart, its predecessor)
        rank_rows = [n or 0 for n in resume.rows_sent] or [0] * len(self.nn_put)
        senders = [asyncio.ensure_future(self._sender(rank, q)) for rank, q in enumerate(queues)]
        sent = 0
        try:
            for seq in itertools.count(resume.first_seq):
                item = await loop.run_in_executor(self.executor, next, prepared, None)
                if item is None:
                    break
                rank, sparse_frame, rows, position = item
                if phase == "train" and self.on_trained is not None and position is not None:
                    self._untrained.append((seq, position))
                if resume.skips(rank, seq):
                    self.servicer.counters["batches_held_by_ranks_total"] += 1
                    continue
                # On failure the next attempt goes to the next embedding worker: a dead one is routed around.
                reply = await rpc.retry(lambda: self.ew_put[next(self.next_ew)](sparse_frame, timeout=self.timeout),
                                        deadline_s=self.retry_s)
                ref = BatchRef.decode(reply).batch_ref
                dense = DenseBatch(ref, rows.dense, rows.labels, phase, seq=seq,
                                   position=tuple(position.as_list()) if position else (),
                                   rows_before=rank_rows[rank], loader=self.loader)
                rank_rows[rank] += len(rows)
                await self._put(queues[rank], senders, (phase, dense.seq, dense.encode()))
                sent += 1
                self.servicer.counters[f"{phase}_batches_total"] += 1
                self.servicer.counters["rows_sent_total"] += len(rows)
            end_seq = seq if phase == "train" else -1  # dealt evenly: every rank's share ends there
            for rank, q in enumerate(queues):
                end = EndOfPhase(phase, end_meta(), loader=self.loader, end_seq=end_seq, rows_sent=rank_rows[rank])
                await self._put(q, senders, (phase, END, end.encode()))
                await self._put(q, senders, _DONE)
            await self._all_delivered(senders)
        finally:
            for task in senders:
                task.cancel()
        self.ended = phase
        return sent

    async def _all_delivered(self, senders: list[asyncio.Task]) -> None:
        """Wait for every rank's sender to deliver its share of the phase. Meanwhile a rank whose sender is done
        is probed every `IDLE_PROBE_S` as an idle sender probes its own (`_probe`): if that rank is replaced
        while another rank's frames still wait for room, the replacement must get its predecessor's
        unconfirmed frames now. It cannot wait until the phase is over: its group waits for it in a collective,
        so the other rank does not take those frames, and the phase would never end."""
        pending = set(senders)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=IDLE_PROBE_S)
            for task in done:
                task.result()  # a sender's failure is the phase's
            for rank, task in enumerate(senders):
                if pending and task.done():
                    await self._probe(rank)

    @staticmethod
    async def _put(queue: asyncio.Queue, senders: list[asyncio.Task], item) -> None:
        for task in senders:  # a failed sender must not leave us blocked on its full queue
            if task.done() and task.exception():
                raise task.exception()
        await queue.put(item)

    async def _sender(self, rank: int, queue: asyncio.Queue) -> None:
        """Deliver rank `rank`'s frames in order; what it has not confirmed is kept for a replacement. While
        there is nothing new to send, every `IDLE_PROBE_S` it checks that the rank still holds what it was
        sent (`_probe`)."""
        window = self.windows[rank]
        put = self.nn_put[rank]
        get: asyncio.Future | None = None
        try:
            while True:
                get = get or asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get}, timeout=IDLE_PROBE_S)  # no cancel on timeout: nothing lost
                if not done:
                    await self._probe(rank)
                    continue
                item, get = get.result(), None
                if item is _DONE:
                    return
                window.add(*item)
                await deliver(window, lambda frame: put(frame, timeout=None), retry_s=self.retry_s)
                self.servicer.counters["frames_resent_total"] = sum(w.resent for w in self.windows)
                self.note_trained()
        finally:
            if get is not None:
                get.cancel()

    async def _probe(self, rank: int) -> None:
        """Send rank `rank` its unconfirmed frames again if another process of it answers than the one they went
        to: a replacement of a lost rank, which would otherwise wait for them (or, for batches the group
        trained, never settle their updates) until this loader's next batch."""
        window = self.windows[rank]
        if not window.delivered:
            return
        try:
            held = await self._ask_received(rank)
        except grpc.aio.AioRpcError:
            return  # still joining (or gone): the next probe asks again
        if window.another_process(held.incarnation):
            await self._deliver_again(rank)
            self.note_trained()

    def note_trained(self, through: list[int] | None = None) -> None:
        """Pass `on_trained` the position after the newest batch trained with every one before it, from the
        ranks' confirmations (or `through`, each rank's last trained training batch, from `received`)."""
        ranks, trained = len(self.windows), []
        while self._untrained:
            seq, position = self._untrained[0]
            rank = seq % ranks
            if not (self.windows[rank].confirmed("train", seq) or (through is not None and through[rank] >= seq)):
                break
            trained.append(position)
            self._untrained.popleft()
        if trained and self.on_trained is not None:
            self.on_trained(trained)


def checkpoint_point(config: Config, loader: int = 0) -> tuple[Position, int]:
    """(position, next batch index) of data loader `loader`'s stream at the newest checkpoint, or the start of
    the data; ConfigError naming cluster.dataloader for a checkpoint of another number of loaders."""
    found = checkpoints.resume_from(config.checkpoint)
    if found is None:
        return Position(), 0
    path, manifest = found
    checkpoints.check_loaders(path, manifest, len(config.cluster.dataloader))
    seq, position = manifest.streams()[loader]
    return Position(*position), seq


def max_batches(config: Config, loader: int) -> int | None:
    """With `training.max_steps`, the training batches loader `loader` sends in all: the ranks take one batch
    a step from each loader in turn (services/nn_worker/inbox.py), so loader l's share of S steps is the number
    of steps s < S with s mod L = l, times the ranks (fewer steps in all when a loader runs out of data first);
    None: no limit."""
    steps = config.training.max_steps
    if steps is None:
        return None
    loaders = len(config.cluster.dataloader)
    return max(0, steps - loader + loaders - 1) // loaders * len(config.cluster.nn_workers)


async def send_training(config: Config, dispatcher: Dispatcher, resume: Resume, counts: ReadCounters,
                        source: TrainingSource) -> int:
    """Read and send the training batches of `source` from `resume` on; returns the number of batches sent."""
    first_seq, loader = resume.train.first_seq, dispatcher.loader
    await source.open(resume.position, dispatcher.executor)  # a stream: a predecessor's account, the consumer
    dispatcher.on_trained = source.on_trained
    items = deal_evenly(source.batches(resume.position, counts), len(config.cluster.nn_workers), counts)
    if (limit := max_batches(config, loader)) is not None:
        items = itertools.islice(items, max(0, limit - first_seq))

    def end_meta() -> dict:  # a restarted loader's counters start at its first batch
        return {**vars(counts), **({"first_seq": first_seq} if first_seq else {})}

    return await dispatcher.run_phase("train", items, end_meta, resume.train)


async def send_eval(config: Config, dispatcher: Dispatcher, resume: Resume, counts: ReadCounters) -> int:
    """Read and send the eval data (this loader's split), dealt round robin, leaving out what each rank holds."""
    num_ranks = len(config.cluster.nn_workers)
    rows = read_eval_rows(config, counts, dispatcher.loader)
    items = ((i % num_ranks, b, None) for i, b in enumerate(iter_batches(rows, config.training.eval_batch_size)))
    return await dispatcher.run_phase("eval", items, lambda: vars(counts).copy(), resume.eval)


async def resume_plan(config: Config, dispatcher: Dispatcher) -> Resume:
    """Where this loader's streams continue, from what the ranks hold and the newest checkpoint (resume.py);
    logged as `resuming` unless it is a first start."""
    resume = plan(await dispatcher.received(), checkpoint_point(config, dispatcher.loader))
    if resume.source != "start" or resume.train.skip_through or resume.train_done:
        log.get().warning("resuming", source=resume.source, seq=resume.train.first_seq,
                          position=resume.position.as_list(), train_done=resume.train_done,
                          held=list(resume.train.skip_through), notes=resume.notes)
    return resume


async def send_data(config: Config, host: ServiceHost, dispatcher: Dispatcher, source: TrainingSource) -> None:
    """Once the workers serve: the training data from where the ranks (or the checkpoint) left it, unless every
    rank has all of it, then the eval data; with `source.waits_after_evaluation`, until every rank is past
    training."""
    await rpc.wait_until_serving(config.cluster.embedding_workers + config.cluster.nn_workers,
                                 timeout_s=config.cluster.start_timeout_s * 5, what="workers")
    started = time.monotonic()
    train_counts, eval_counts = ReadCounters(), ReadCounters()
    dispatcher.servicer.reads = [train_counts, eval_counts]
    resume = await resume_plan(config, dispatcher)
    if resume.train_done:  # every rank has the end of training
        await source.settle_trained()
    else:
        n = await send_training(config, dispatcher, resume, train_counts, source)
        host.log.info("train_data_sent", batches=n, **vars(train_counts), wall_s=round(time.monotonic() - started, 2))
        await source.end_training(dispatcher.wait_trained)
    n = await send_eval(config, dispatcher, resume, eval_counts)
    host.log.info("eval_data_sent", batches=n, **vars(eval_counts))
    if source.waits_after_evaluation and await dispatcher.wait_trained():
        host.log.info("ranks_past_training", wall_s=round(time.monotonic() - started, 2))


def check_replica(config: Config, replica: int) -> None:
    """ConfigError for a replica number that `cluster.dataloader` does not list."""
    loaders = len(config.cluster.dataloader)
    if not 0 <= replica < loaders:
        raise ConfigError(f"--replica {replica}: cluster.dataloader lists {loaders} data loader"
                          f"{'s' if loaders != 1 else ''} (0..{loaders - 1})")


async def serve(config: Config, replica: int) -> None:
    """Data loader `replica`: check its data, serve, send its training and eval data (`send_data`), exit."""
    check_replica(config, replica)
    check_prepared(config)  # bad prepared data stops the loader at once, naming the file (not once workers are up)
    check_splits(config)  # as does a layout that leaves a loader no training data, naming cluster.dataloader
    host = ServiceHost("dataloader", config, replica)
    servicer = DataLoaderServicer(replica)
    host.add(servicer, servicer.stats)
    await host.start()
    await host.set_serving(True)
    dispatcher = Dispatcher(config, servicer, replica)
    source: TrainingSource | None = None
    try:
        source = training_source(config, replica)  # files or a stream, chosen once
        source.handle_signals(asyncio.get_running_loop())
        await host.run_until_stopped(asyncio.ensure_future(send_data(config, host, dispatcher, source)))
    finally:
        await dispatcher.close()
        if source is not None:
            source.close()
