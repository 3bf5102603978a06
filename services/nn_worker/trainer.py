"""On the NN worker: the training loop of the hybrid algorithm (docs/architecture.md#one-training-batch, steps 3–6).

Two coroutines share the event loop and one compute thread does the math (`StepMath`, step.py):

* the prefetcher takes dense batches as the data loaders deliver them (from
  several loaders in the one order every rank follows: inbox.py) and starts
  the embedding lookup of each on its embedding worker, up to `prefetch` batches
  ahead of compute — but only while the staleness bound allows: a lookup starts
  only when at most `staleness` earlier batches have unapplied updates
  (`StalenessGate`, staleness.py: staleness + 1 permits, released when a gradient push is acked);
* the step loop waits for a batch's embeddings, runs forward/backward/optimizer
  on the compute thread (DDP AllReduces dense gradients there), and sends the
  embedding gradients back without waiting for them (hybrid) — or waits for
  every replica's updates before the next lookup (sync).

All torch and torch.distributed calls run on the single compute thread, so
collectives are issued in the same order on every rank.

`run` is the loop, `train_step` one step of it. After each step the checkpointer and the publisher are called
and decide themselves whether to write (`Checkpointer.maybe_save`, `Publisher.maybe_publish`).

What the trainer holds apart from the pipeline is each in its own owner: a step's math (`StepMath`), the
rank's place in each data loader's stream (`Ledger`, ledger.py, shared with the servicer), and its membership
of the dense group, which survives a lost peer (`DenseGroup`, group/dense_group.py): `trainer.group`, which the
server and the checkpointer call directly.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import numpy as np
import torch

from hybridrec.core.runtime import log
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.runtime.service import at_work
from hybridrec.core.config import Config, ConfigError, Mode
from hybridrec.core.wire.frames import Applied, DenseBatch, EndOfPhase, Gradients
from hybridrec.core.model.pooling import BatchEmbeddings, Pooler
from hybridrec.core.model.tasks import Tasks
from services.nn_worker.compute import ComputeThread
from services.nn_worker.group.distributed import DistEnv, barrier
from services.nn_worker.feed import ready
from services.nn_worker.group.dense_group import DenseGroup
from services.nn_worker.inbox import Inbox, merge_ends, next_loader
from services.nn_worker.ledger import Ledger, Order
from services.nn_worker.group.membership import Membership
from services.nn_worker.progressive import ProgressiveWindow
from services.nn_worker.routing import BatchLost, Looked
from services.nn_worker.staleness import StalenessGate
from services.nn_worker.stats import TrainStats
from services.nn_worker.step import StepMath, StepOutput

if TYPE_CHECKING:
    from services.nn_worker.checkpoint import Checkpointer
    from services.nn_worker.publish import Publisher


Lookup = Callable[[int, int], Awaitable[Looked]]  # (batch_ref, batch size) -> the batch's embeddings' frame
Push = Callable[..., Awaitable[Applied]]  # (batch_ref, packed gradients[, slot, frame bytes]) -> the PS's answer


class NonFiniteStep(ConfigError):
    """`training.on_nonfinite: stop`: a step's loss or gradients were not finite. It updated nothing, and the run
    stops before a checkpoint is written; the message names the step, the rank and the batch. (A ConfigError:
    the process stops naming the key, and is not started again to meet the same batch.)"""


@dataclass(frozen=True)
class Collaborators:
    """What the trainer calls on besides the embedding workers, built before it (server.py) and handed to its
    constructor. None of them holds the trainer: the checkpointer is handed the dense group (`DenseGroup`) on
    each call; the publisher holds the model and the compute thread; membership needs nothing of it."""

    checkpointer: Checkpointer | None = None
    """Synchronised job checkpoints (every rank); None: none (tests)."""
    publisher: Publisher | None = None
    """Live model versions: rank 0, when `publish` is enabled."""
    membership: Membership | None = None
    """Re-forms the group around a lost peer's replacement (modes whose group survives losing a rank); None:
    a lost peer stops this rank."""


class Trainer:
    """Rank `env.rank`'s training loop (`run`, one `train_step` a batch) and evaluation (`evaluate`), as the
    module docstring lays them out; what it holds apart from the pipeline is each in its own owner (`math`,
    `ledger`, `group`, `gate`), built here and public for the server."""

    def __init__(self, config: Config, env: DistEnv, model: torch.nn.Module, lookup: Lookup, push: Push,
                 inbox: Inbox, compute: ComputeThread, collaborators: Collaborators = Collaborators(),
                 outgoing: Callable[[], Any] | None = None, ledger: Ledger | None = None):
        """`outgoing`: with a receiver process, a free shared-memory slot for a step's gradient frame
        (`ReceiverLink.outgoing`): the compute thread writes the frame there, `push` sends it. `ledger`: this
        rank's place in each data loader's stream, shared with the servicer that receives the batches (a fresh
        one when None: tests)."""
        self.config, self.env = config, env
        self.training = config.training
        self.lookup, self.push, self.inbox, self.outgoing = lookup, push, inbox, outgoing
        self.log = log.get()
        self.compute = compute
        self.values = ValueCodec(fp16=self.training.compression.fp16, kappa=self.training.compression.kappa)
        self.pooler = Pooler(config.features, self.values)
        self.math = StepMath(model, env, self.training, Tasks.from_config(config), self.pooler)
        self.checkpointer = collaborators.checkpointer
        self.publisher = collaborators.publisher
        staleness_bound = 0 if self.training.mode == Mode.SYNC else self.training.staleness
        self.stats = TrainStats(staleness_hist=np.zeros(staleness_bound + 1, np.int64))
        self.gate = StalenessGate(staleness_bound, self.stats.staleness_hist)
        self.progressive = ProgressiveWindow(max(1, self.training.progressive_window // env.world_size),
                                             config.num_tasks)
        self._auc_at = -1  # the window's `seen` when train_auc was last computed
        self.ledger = ledger if ledger is not None else Ledger(env.rank, env.world_size,
                                                               len(config.cluster.dataloader))
        self.group = DenseGroup(config, env, self.math, self.stats, self.ledger, compute, collaborators.membership)
        """The rank's place in the dense group: every torch call runs through it (`on_compute`, `collective`); the
        server sets it up and the checkpointer is handed it."""
        self._pushes: set[asyncio.Task] = set()  # steps' gradient pushes not yet acknowledged (`_push_step`)
        self._replays: set[asyncio.Task] = set()  # owed updates being settled (`_settle`)
        self._stopped: NonFiniteStep | None = None  # set by a non-finite step under on_nonfinite: stop

    @property
    def model(self) -> torch.nn.Module:
        """The dense model (`StepMath` owns it), for the final save."""
        return self.math.model

    @property
    def in_flight(self) -> int:
        """Batches looked up whose updates are not yet acknowledged (`StalenessGate.in_flight`)."""
        return self.gate.in_flight

    async def _push(self, ref: int, tensors: dict[str, np.ndarray] | None, into: Any = None,
                    nbytes: int | None = None) -> None:
        """Send a batch's packed gradients (its `Gradients` frame's tensors, None for a discard; or its frame,
        `nbytes` long, in the receiver's slot `into`) and note which life of each PS shard acknowledged them
        (`TrainStats.ps_acks`)."""
        applied = await (self.push(ref, tensors) if into is None else self.push(ref, tensors, into, nbytes))
        self.stats.ps_acks.update(applied.lives)

    # -- training ----------------------------------------------------------------------------
    async def _batches(self, phase: str, before_lookup: Callable[[], Awaitable[None]] | None = None,
                       end: dict | None = None) -> AsyncIterator[tuple[DenseBatch, asyncio.Future]]:
        """One phase's batches in order, each with its embedding lookup already started.

        A prefetcher keeps up to `prefetch` lookups in flight ahead of the consumer;
        `before_lookup` (the staleness gate) runs before each lookup starts. The
        end-of-phase meta the data loader sent is stored in `end`.
        """
        ready: asyncio.Queue = asyncio.Queue(maxsize=self.training.prefetch)

        async def prefetcher() -> None:
            try:
                while (item := await self._take(phase)) is not None:
                    if before_lookup is not None:
                        await before_lookup()
                    lookup = asyncio.ensure_future(self.lookup(item.batch_ref, item.labels.shape[0]))
                    await ready.put((item, lookup))
                if end is not None:
                    end.update(merge_ends(self.ledger.ends_taken[phase]))
                await ready.put(None)
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                await ready.put(exc)

        fetch = asyncio.ensure_future(prefetcher())
        try:
            while (entry := await ready.get()) is not None:
                if isinstance(entry, Exception):
                    raise entry
                yield entry
        finally:
            if not fetch.done():
                fetch.cancel()

    async def _take(self, phase: str) -> DenseBatch | None:
        """The phase's next batch, None once every data loader's end of it is taken (`Ledger.ends_taken`).

        Training: from the loader `inbox.next_loader` names (the order every rank follows), after dropping what
        the group trained already (`_in_sequence`); evaluation: from whichever loader has one first."""
        ended = self.ledger.ends_taken[phase]
        while True:
            if phase == "train":
                loader = next_loader(self.ledger.next_seqs, set(ended))
                if loader is None:
                    return None
                item = await self.inbox.get(loader)
            else:
                live = [loader for loader in range(len(self.ledger)) if loader not in ended]
                if not live:
                    return None
                item = await self.inbox.get_any(live)
            if item.phase != phase:
                what = "batch" if isinstance(item, DenseBatch) else "end"
                raise RuntimeError(f"got a {item.phase} {what} from data loader {item.loader} while expecting "
                                   f"{phase} batches")
            if isinstance(item, EndOfPhase):
                if phase == "train":
                    self.ledger.check_end(item)
                    self.stats.samples += self.ledger.count_predecessor(item.loader, item.rows_sent)  # all trained
                ended[item.loader] = item
                continue
            if phase == "train":
                if not self._in_sequence(item):
                    continue
                # A replacement counts its predecessor's share with the first batch or end it takes of a loader,
                # as they are taken, in stream order: a loader's last batch and its end can be taken before
                # that batch is trained.
                self.stats.samples += self.ledger.count_predecessor(item.loader, item.rows_before)
            return item

    def _in_sequence(self, batch: DenseBatch) -> bool:
        """False for a re-sent batch the group trained already (its update is settled in the background, see
        `_settle`); raises on a gap in the stream."""
        if self.ledger.take(batch) is Order.SETTLE:
            self.stats.replayed_dropped += 1
            # Trained in a group step by this rank's predecessor, which may have died before its own
            # `batch_trained` line: with HYBRIDREC_LOG_LEVEL=DEBUG an audit finds every batch in one of the two.
            self.log.debug("batch_settled", loader=batch.loader, seq=batch.seq, batch_ref=batch.batch_ref,
                           rows=int(batch.labels.shape[0]), position=list(batch.position))
            task = asyncio.ensure_future(self._settle(batch))
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)
            return False
        return True

    async def run(self) -> dict:
        """The training loop: one `train_step` for each training batch, in the order every rank takes them; after
        each, the checkpointer and the publisher, which decide themselves whether to write. Then every update
        settled, the final checkpoint and the final version. Returns the data loaders' account of the phase."""
        end: dict = {}
        checkpointer = self.checkpointer
        # Per loader, the (seq, position) of its newest batch trained: where its stream resumes.
        last = list(checkpointer.resumed_at) if checkpointer is not None else []
        last += [(-1, (0, 0, 0, 0))] * (len(self.ledger) - len(last))
        async with contextlib.aclosing(self._batches("train", self.gate.enter, end)) as batches:
            async for batch, pending in batches:
                last[batch.loader] = (batch.seq, tuple(batch.position))
                await self.train_step(batch, pending)
                if checkpointer is not None:
                    await checkpointer.maybe_save(self.group, self.stats.steps, last, self._drain)
                if self.publisher is not None:
                    await self.publisher.maybe_publish(self.stats.steps)
        if self._pushes or self._replays:
            await asyncio.gather(*self._pushes, *self._replays)
        self._raise_if_stopped()
        await self.group.on_compute(self.math.sync.finish)
        self.stats.finished = time.monotonic()
        if checkpointer is not None:  # every push is acknowledged, the replicas are identical: the model evaluated next
            await checkpointer.finish(self.group, self.stats.steps, last)
        if self.publisher is not None:  # after the final checkpoint's barrier: every rank's updates are applied
            await self.publisher.finish(self.stats.steps)
        return end

    async def train_step(self, batch: DenseBatch, pending: asyncio.Future) -> None:
        """One training step: wait for the batch's embeddings (`pending`, its lookup), run the step on the compute
        thread through the group (a lost peer re-forms it), and send the embedding gradients back without
        waiting for the PS (hybrid) — or waiting, and meeting every rank, in sync mode."""
        waited = time.perf_counter()
        emb, lost, looked = await self._receive(pending, batch)
        if self.stats.started is None:
            self.stats.started = time.monotonic()
            at_work("training step")
        else:  # the first batch's wait is start-up, not exposed communication
            self.stats.exposed_wait_s += time.perf_counter() - waited
        # A lost batch still takes a (zero-weighted) step: every rank must run the same
        # number of DDP all-reduces, or the group deadlocks.
        computed = time.perf_counter()
        out = self.outgoing() if self.outgoing is not None and not lost else None
        step = await self.group.collective(self._compute_step, batch, emb, lost, out)
        looked.release()  # the step is done with the batch's arrays (on a GPU: they are staged)
        self.stats.compute_s += time.perf_counter() - computed
        self.log.debug("batch_trained", loader=batch.loader, seq=batch.seq, batch_ref=batch.batch_ref,
                       rows=int(batch.labels.shape[0]), position=list(batch.position),
                       lost=lost)  # HYBRIDREC_LOG_LEVEL=DEBUG: each once?
        self.ledger.trained(batch)
        self._raise_if_stopped()  # on the CPU a step's outputs are known by now
        task = asyncio.ensure_future(self._push_step(step, lost, batch, self.stats.steps))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)
        if self.training.mode == Mode.SYNC:
            waited = time.perf_counter()
            await task
            await self.group.collective(barrier, after_regroup=None)
            self.stats.exposed_wait_s += time.perf_counter() - waited
        self.stats.samples += batch.labels.shape[0]

    async def _push_step(self, step: StepOutput, lost: bool, batch: DenseBatch, number: int) -> None:
        """Step `number`'s gradients to the PS (on a GPU, once they reach the host: then its loss is recorded
        too), in the background; the batch is acknowledged in the ledger and its staleness permit freed whether
        the push succeeded or not."""
        ref, loader, seq = batch.batch_ref, batch.loader, batch.seq
        try:
            if step.event is not None:  # on a GPU: the step's gradients and loss are on their way to the host
                await ready(step.event)
                self._record(step, batch.labels, lost)
                if step.nonfinite:
                    self._note_nonfinite(number, batch, step)
            if not lost:  # a skipped batch: nothing to send, but its permit is returned
                await self._push(ref, None if step.nonfinite else step.packed(), step.out, step.written)
        except Exception as exc:  # noqa: BLE001 - a lost update is counted, training goes on (Persia §4.2.4)
            self.stats.pushes_failed += 1
            self.log.warning("gradient_push_failed", batch_ref=ref, error=str(exc))
        finally:
            self.ledger.acknowledged(loader, seq)
            self.gate.acknowledged()

    async def _drain(self) -> None:
        """Before a checkpoint is written (`Checkpointer.maybe_save` calls it once one is due): every push of
        this rank acknowledged, for the PS must hold every update up to this step; and a step that was not
        finite stops the run before it (on a GPU, a step's outputs are known once its push is done)."""
        if self._pushes:
            await asyncio.gather(*self._pushes)
        self._raise_if_stopped()

    async def _receive(self, pending: asyncio.Future,
                       batch: DenseBatch) -> tuple[BatchEmbeddings, bool, Looked]:
        """The batch's embeddings, or empty ones and True when its embedding worker lost it; and the frame
        they view, to release once the step is done with them."""
        try:
            looked = await pending
            try:
                return self._decode(looked, batch.labels.shape[0]), False, looked
            except BaseException:
                looked.release()
                raise
        except BatchLost as exc:
            self.log.warning("batch_skipped", batch_ref=batch.batch_ref, phase=batch.phase, reason=str(exc))
            if batch.phase == "train":
                self.stats.skipped_batches += 1
            else:
                self.stats.skipped_eval_batches += 1
            return self.pooler.empty(batch.labels.shape[0]), True, Looked(b"")

    def _decode(self, looked: Looked, batch_size: int) -> BatchEmbeddings:
        """The batch's embeddings: views of the receiver's checked frame, or the embedding worker's decoded."""
        if looked.checked:
            return self.pooler.from_checked(looked.frame, batch_size)
        return self.pooler.decode(looked.frame, batch_size)

    async def _settle(self, batch: DenseBatch) -> None:
        """A re-sent batch the group trained already: if its embedding worker still holds it, the update was
        lost with this rank's predecessor (the worker drops a batch once its update is applied). Its embedding
        gradients are derived again under the current dense model — which is a few steps newer, like any
        bounded-staleness update — and pushed; the dense model is not touched."""
        try:
            looked = await self.lookup(batch.batch_ref, batch.labels.shape[0])
            try:
                emb = self._decode(looked, batch.labels.shape[0])
                grads = await self.group.on_compute(self.math.embedding_gradients, batch, emb)
            finally:
                looked.release()
            finite = all(np.isfinite(g).all() for g in grads.values())
            if not finite:
                self.log.warning("update_replay_discarded", batch_ref=batch.batch_ref, why="not finite")
            await self._push(batch.batch_ref, Gradients(batch.batch_ref, grads).packed(self.values) if finite else None)
            self.stats.updates_replayed += 1
            self.log.info("update_replayed", batch_ref=batch.batch_ref, seq=batch.seq)
        except BatchLost:
            return  # applied before the predecessor died (or lost with its worker: counted there)
        except Exception as exc:  # noqa: BLE001 - it stays owed: the end-of-run count reports it as lost
            self.log.warning("update_replay_failed", batch_ref=batch.batch_ref, error=str(exc))
        finally:
            self.ledger.settled(batch.loader, batch.seq)

    def _compute_step(self, batch: DenseBatch, emb: BatchEmbeddings, lost: bool = False,
                      out: Any = None) -> StepOutput:
        """Compute thread: a step's math (`StepMath.train`), counted. On the CPU it records its loss and
        predictions itself (`_record`, while they are in this core's cache, off the event loop); on a GPU
        `_push_step` records them once they reach the host."""
        cpu_started = time.thread_time()
        step = self.math.train(batch, emb, self.stats.steps + 1, lost, out)
        self.stats.steps += 1
        if step.event is None:
            self._record(step, batch.labels, lost)
            if step.nonfinite:
                self._note_nonfinite(self.stats.steps, batch, step)
        self.stats.compute_cpu_s += time.thread_time() - cpu_started
        return step

    def _note_nonfinite(self, number: int, batch: DenseBatch, step: StepOutput) -> None:
        """Step `number` was not finite (on this rank or another: they agree) and updated nothing: counted, and
        under `training.on_nonfinite: stop` the run stops at the next check (`_raise_if_stopped`)."""
        self.stats.nonfinite_steps += 1
        self.log.warning("nonfinite_step", step=number, rank=self.env.rank, loader=batch.loader, seq=batch.seq,
                         batch_ref=batch.batch_ref, loss=step.loss(), action=self.training.on_nonfinite)
        if self.training.on_nonfinite == "stop" and self._stopped is None:
            self._stopped = NonFiniteStep(
                f"training.on_nonfinite: stop: step {number} on NN worker rank {self.env.rank} (batch {batch.seq} "
                f"of data loader {batch.loader}) had a loss or gradient that is not finite (loss {step.loss()}); it "
                f"updated nothing, and no checkpoint holds it")

    def _raise_if_stopped(self) -> None:
        if self._stopped is not None:
            raise self._stopped

    def _record(self, step: StepOutput, labels: np.ndarray, lost: bool) -> None:
        """Once a step's outputs are on the host (the compute thread on the CPU, the event loop on a GPU): its
        loss, and (unless the batch was lost) its predictions, made before the step trained on them, into the
        progressive window: O(batch). (`refresh_train_auc` may count the window meanwhile: a slot it reads
        holds the old sample or the new one, each a valid one.) A step that was not finite records nothing: its
        loss would make the mean NaN, and its predictions say nothing."""
        if step.nonfinite:
            return
        loss = step.loss()
        self.stats.last_loss = loss
        self.stats.loss_sum += loss
        self.stats.loss_count += 1
        if not lost:
            self.progressive.add(step.host["logits"].numpy(), labels)

    def refresh_train_auc(self) -> float:
        """The progressive window's AUC (the first task's) as `stats.train_auc`: O(window + buckets), so computed
        when asked (status, metrics: about once a second), only when the window changed, and without the log
        loss, which the progress line does not show (its logarithms were half of a `Status` call). A first task
        that is a regression has no AUC: NaN."""
        if self.progressive.seen != self._auc_at and self.math.tasks.specs[0].binary:
            self._auc_at = self.progressive.seen
            auc = self.progressive.auc(0)
            if auc == auc:  # a window of one class keeps the last AUC (and a replacement its predecessor's)
                self.stats.train_auc = auc
        return self.stats.train_auc

    # -- evaluation --------------------------------------------------------------------------
    async def evaluate(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """Predictions and labels (weight column included) of every eval batch this rank received."""
        preds: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        end: dict = {}
        async with contextlib.aclosing(self._batches("eval", end=end)) as batches:
            async for batch, pending in batches:
                emb, lost, looked = await self._receive(pending, batch)
                if lost:
                    continue
                preds.append(await self.group.on_compute(self.math.predict, batch, emb))
                looked.release()
                labels.append(np.array(batch.labels))
                self.ledger.predicted(batch.loader, batch.seq)
        tasks, columns = self.config.num_tasks, self.config.label_columns
        empty = lambda n: np.zeros((0,) if n == 1 else (0, n), np.float32)  # noqa: E731
        return (np.concatenate(preds) if preds else empty(tasks), np.concatenate(labels) if labels else empty(columns),
                end)
