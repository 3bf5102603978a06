"""`hybridrec serve nn_worker`: rank r of the synchronous dense group.

Receives dense batches from the data loaders (a bounded inbox per loader:
back-pressure on that loader; inbox.py), trains through `Trainer`, evaluates, and — on rank 0 — writes the
run's results to output.dir/summary.json. The process exits 0 when it is done,
which is how the launcher, Compose and a Kubernetes Job see completion.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path

import grpc
import torch

from hybridrec.core.layouts import checkpoints
from hybridrec.core.runtime import log
from hybridrec.core.config import AUTO, Config, Mode
from hybridrec.core.wire.frames import Consumed, DenseBatch, EndOfPhase, Received
from hybridrec.core.model.models import build_model, feature_infos
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime import rpc
from hybridrec.core.runtime.service import EXIT_PEER_LOST, ServiceHost
from services.nn_worker import admission, progressive
from services.nn_worker.checkpoint import Checkpointer, check_resumable, on_cpu
from services.nn_worker.compute import ComputeThread
from services.nn_worker.group.distributed import barrier, close_groups, pin_interface, resolve_backend
from services.nn_worker.inbox import Inbox
from services.nn_worker.ledger import Ledger
from services.nn_worker.receiver.receiver_link import ReceiverLink
from services.nn_worker.group.membership import Fingerprint, Membership, failure_line, is_group_failure
from services.nn_worker.publish import Publisher
from services.nn_worker.results import build_summary, gather_eval, reduce_stats, reduce_window
from services.nn_worker.routing import EmbeddingWorkers
from services.nn_worker.lr_decay import LrDecay
from services.nn_worker.step import make_dense_optimizer
from services.nn_worker.trainer import Collaborators, Trainer


RECOVERABLE_MODES = (Mode.HYBRID, Mode.SYNC)
"""Modes whose group survives losing a rank: the replicas are identical after every step (DDP), so any
survivor's state is the group's. (async and shadow average replicas on their own schedule.)"""


class NNWorkerServicer:
    def __init__(self, config: Config, replica: int, inbox: Inbox, ledger: Ledger):
        """`ledger`: this rank's place in each data loader's stream, shared with the trainer, which opens it once
        the group's state is known (`Ledger.opened`)."""
        self.config, self.replica, self.inbox, self.ledger = config, replica, inbox, ledger
        self.trainer: Trainer | None = None  # for its progress (Status, Stats) once it exists
        self.link: ReceiverLink | None = None  # with training.receiver
        self.phase = "starting"
        self.duplicates = 0
        self.eval_metrics: dict[str, float] = {}  # rank 0, after evaluation: eval_auc_<task>, eval_logloss_<task>
        self.incarnation = secrets.randbits(62) | 1  # this process, in every reply to a loader (never 0)
        self.told_past_training: set[int] = set()  # loaders this rank has answered that it finished training
        self.all_told = asyncio.Event()

    async def PutBatch(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Queue a batch for the trainer (`admission.admit_frame`, the path the receiver's batches take too; then
        `admit` if it must wait for room); the reply says how far this rank has trained that loader's stream."""
        item, consumed = admission.admit_frame(request, self.config, self.inbox.loaders, self)
        return (consumed if consumed is not None else await self.admit(item)).encode()

    async def admit(self, item: DenseBatch | EndOfPhase) -> Consumed:
        """Queue what a data loader sent for the trainer; a re-sent one (a data loader replays what this rank
        has not yet confirmed after any failed call) is dropped here. Answers how far this rank has trained that
        loader's stream.

        A batch counts as received only once it is in the inbox: a call cut off while waiting for room (its
        loader died) leaves no trace, and a restarted loader sends that batch again."""
        if not self.ledger.is_fresh(item):
            self.duplicates += 1
        else:
            await self.inbox.put(item)
            self.ledger.received(item)
        return self._consumed(item.loader)

    def admit_now(self, item: DenseBatch | EndOfPhase) -> Consumed | None:
        """`admit` where it need not wait (the loader's queue has room, or `item` is a duplicate); None, and
        nothing done, where it must. Every batch takes this path first (`admission.admit_frame`): no coroutine
        per batch on the trainer's event loop (services/nn_worker/receiver/receiver_link.py)."""
        if not self.ledger.is_fresh(item):
            self.duplicates += 1
        elif self.inbox.put_nowait(item):
            self.ledger.received(item)
        else:
            return None
        return self._consumed(item.loader)

    def _consumed(self, loader: int) -> Consumed:
        consumed = self.ledger.consumed(loader)
        return Consumed(consumed.phase, consumed.through, self.incarnation)

    async def Received(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """How far this rank holds each phase's stream of the data loader the request names, for a (re)started
        loader: what it received, or what the group had trained when this process took over (a replacement, or
        a restored checkpoint)."""
        if not self.ledger.opened:
            raise rpc.Unavailable("the NN worker is still joining its group")
        loader = Received.loader_of(request, self.inbox.loaders)
        state = self.ledger.loaders[loader]
        through = {"train": self.ledger.held(loader), "eval": state.received["eval"]}
        past_training = self.phase in ("eval", "done")
        ended = set(state.ended) | ({"train"} if past_training else set())
        reply = Received(through, frozenset(ended), list(state.marks), loader, self.incarnation,
                         past_training).encode()
        if past_training:
            self.told_past_training.add(loader)
            if len(self.told_past_training) == self.inbox.loaders:
                self.all_told.set()
        return reply

    async def linger(self) -> None:
        """Once done, stay up until every data loader has heard that this rank finished training (or
        `cluster.retry_s` has passed). With several loaders each waits for that before it exits (it would
        resend its share to a replacement of a rank lost meanwhile); a rank gone before a loader asked would
        leave that loader waiting `cluster.rejoin_timeout_s` for a replacement that never comes."""
        if self.inbox.loaders < 2 or self.config.data.stream is not None:
            return  # a single loader, or a stream's (asked before its evaluation), waits for no rank's end
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.all_told.wait(), timeout=self.config.cluster.retry_s)
            log.get().info("loaders_told", loaders=self.inbox.loaders, waited_s=round(time.monotonic() - started, 3))
        except asyncio.TimeoutError:
            log.get().warning("loaders_not_told", told=sorted(self.told_past_training), loaders=self.inbox.loaders,
                              waited_s=self.config.cluster.retry_s)

    async def Status(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.TrainingStatus:
        stats = self.trainer.stats if self.trainer else None
        if stats is None:
            return pb.TrainingStatus(phase=self.phase)
        return pb.TrainingStatus(done=self.phase == "done", step=stats.steps, samples=stats.samples,
                                 loss=stats.last_loss, phase=self.phase, train_auc=self.trainer.refresh_train_auc(),
                                 train_s=stats.trained_here_s,
                                 samples_per_sec=stats.samples / stats.wall_s if stats.wall_s else 0.0)

    def stats(self) -> dict[str, float]:
        values = {"inbox_batches": float(self.inbox.qsize())}
        if self.trainer:
            s = self.trainer.stats
            values.update(steps_total=s.steps, samples_total=s.samples, loss=s.last_loss,
                          train_auc=self.trainer.refresh_train_auc(),
                          samples_per_sec=s.samples / s.wall_s if s.wall_s else 0.0,
                          batches_in_flight=self.trainer.in_flight, lost_updates_total=s.pushes_failed,
                          skipped_batches_total=s.skipped_batches, nonfinite_steps_total=s.nonfinite_steps,
                          exposed_wait_seconds_total=s.exposed_wait_s, compute_seconds_total=s.compute_s,
                          group_reformations_total=s.regroups, replayed_batches_dropped_total=s.replayed_dropped,
                          updates_replayed_total=s.updates_replayed,
                          duplicate_frames_total=self.duplicates)
            if self.link is not None:
                values.update(receivers_replaced_total=self.link.replaced)
            if self.trainer.publisher is not None:
                values.update(self.trainer.publisher.metrics())
        values.update(self.eval_metrics)
        return {k: float(v) for k, v in values.items()}

    async def Stats(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.ServiceStats:
        return pb.ServiceStats(service="nn_worker", replica=self.replica, values=self.stats())


def torch_threads(config: Config) -> int:
    """`training.torch_threads`; `auto` here (an NN worker started alone: `hybridrec run` sizes it to the host)
    is the cores this process may run on less one for its event loop."""
    threads = config.training.torch_threads
    return max(1, len(os.sched_getaffinity(0)) - 1) if threads == AUTO else threads


async def serve(config: Config, replica: int) -> None:
    """Run rank `replica` to the end; exits EXIT_PEER_LOST when it stops only because a peer went away and the
    group could not be re-formed around it (e.g. a collective outside a training step failed), so a supervisor
    can tell that from the process's own failure (exit 1, not restarted by `hybridrec run`)."""
    try:
        await _serve(config, replica)
    except Exception as exc:
        if not is_group_failure(exc):
            raise
        log.get().error("peer_lost", error=failure_line(exc), exit_code=EXIT_PEER_LOST)
        raise SystemExit(EXIT_PEER_LOST) from exc


async def _serve(config: Config, replica: int) -> None:
    started = time.monotonic()
    # With training.receiver, a receiver process holds this rank's network face: its gRPC server and its calls
    # to the embedding workers (services/nn_worker/receiver/process.py).
    link = ReceiverLink(config, replica) if config.training.receiver else None
    host = ServiceHost("nn_worker", config, replica, remote_server=link)
    checkpoints.check_root(config.checkpoint.dir)
    world_size = len(config.cluster.nn_workers)
    torch.set_num_threads(torch_threads(config))
    torch.manual_seed(config.training.seed)
    inbox = Inbox(len(config.cluster.dataloader), maxsize=config.training.prefetch + 2)
    ledger = Ledger(replica, world_size, len(config.cluster.dataloader))
    servicer = NNWorkerServicer(config, replica, inbox, ledger)
    host.add(servicer, servicer.stats)

    workers = link if link is not None else EmbeddingWorkers(config)
    servicer.link = link

    env = resolve_backend(config.training.backend, replica, world_size)  # a bad backend stops it before it listens
    await host.start()
    compute = ComputeThread("compute", initializer=env.bind_thread)
    loop = asyncio.get_running_loop()
    pin_interface(config.cluster.bind_host)
    model = build_model(config.model.path, feature_infos(config.features),
                        config.num_dense, config.model.kwargs, num_tasks=config.num_tasks)
    check_resumable(config, model, make_dense_optimizer)  # another model's checkpoint: exit 2 before joining
    LrDecay.from_config(config)  # a learning-rate fall over a run whose length cannot be counted here: the same
    progressive.warm_up()  # its kernel loaded now, not in the first step (a no-op after the fork server's)
    membership = Membership.from_config(config.cluster, replica, Fingerprint.of(config, model), env.backend,
                                        env.device)
    plan = await loop.run_in_executor(compute, membership.join, None)
    host.log.info("process_group_ready", backend=env.backend, device=str(env.device), world_size=world_size,
                  generation=plan.generation, source=plan.source)
    checkpointer = Checkpointer(config, replica, world_size)
    publisher = Publisher(config, model, compute) if replica == 0 and config.publish.enabled else None
    trainer = Trainer(config, env, model, workers.lookup, workers.push, inbox, compute, Collaborators(
        checkpointer=checkpointer, publisher=publisher,
        membership=membership if config.training.mode in RECOVERABLE_MODES else None),
        outgoing=link.outgoing if link is not None else None, ledger=ledger)
    plan = await trainer.group.setup(plan)
    if plan.source is None:  # nobody holds state: the first start, or the whole group was lost
        manifest = await checkpointer.restore(trainer.group)
        ledger.resume_at([0] * len(ledger) if manifest is None
                         else [seq // world_size for seq, _ in manifest.streams()])
    else:
        host.log.warning("replaced_a_lost_rank", step=plan.step, source=plan.source, generation=plan.generation)
    if publisher is not None:
        publisher.start_clock()  # its time interval counts from here, after set-up and restore
    servicer.trainer = trainer
    ledger.open()  # the group's state is known: batches can be placed in its streams from here
    await rpc.wait_until_serving(config.cluster.embedding_workers, timeout_s=config.cluster.start_timeout_s,
                                 what="embedding workers")
    await host.set_serving(True)

    async def main() -> None:
        servicer.phase = "train"
        end_train = await trainer.run()
        host.log.info("train_done", steps=trainer.stats.steps, samples=trainer.stats.samples,
                      wall_s=round(trainer.stats.wall_s, 2),
                      ps_acks=[[shard, str(life), n] for (shard, life), n in sorted(trainer.stats.ps_acks.items())])
        servicer.phase = "eval"
        preds, labels, end_eval = await trainer.evaluate()
        all_preds, all_labels = await loop.run_in_executor(compute, gather_eval, preds, labels, world_size)
        window = await loop.run_in_executor(compute, reduce_window, trainer.progressive)
        totals = await loop.run_in_executor(compute, reduce_stats, trainer)
        if replica == 0:
            summary = build_summary(config, totals, all_labels, all_preds, started=started,
                                    data={"train": end_train, "eval": end_eval}, progressive=window,
                                    publish=publisher.summary() if publisher else None)
            if checkpointer.final_path is not None:
                summary.checkpoint, summary.checkpoint_s = str(checkpointer.final_path), checkpointer.final_s
            summary.write(Path(config.output.dir) / "summary.json")
            torch.save(on_cpu(trainer.model.state_dict()), Path(config.output.dir) / "dense_model.pt")
            host.log.info("summary_written", auc=summary.auc, logloss=summary.logloss)
            servicer.eval_metrics = summary.task_metrics()
        await loop.run_in_executor(compute, barrier)
        servicer.phase = "done"
        await servicer.linger()

    try:
        await host.run_until_stopped(asyncio.ensure_future(main()))
    finally:
        await workers.close()
        close_groups()
        compute.shutdown(wait=False, cancel_futures=True)
