"""On the NN worker: the rank's membership of its dense group, apart from the training pipeline.

`DenseGroup` forms the group's dense synchronisation (`DenseSync`) once the rank has joined, runs collectives
on the compute thread, and — in the modes whose group survives losing a rank (`Membership`) — re-forms the
group when a peer is lost: the survivors and the peer's replacement join the next generation, the source hands
every rank its model, optimizer, counters and each loader's step count (`handover.hand_over`), and the
replacement takes its predecessor's place in each data loader's stream (`Ledger.take_over`).
docs/architecture.md#replacing-an-nn-worker says why it is done this way.

The trainer (trainer.py) runs its steps through `collective` and holds the group as `trainer.group`; the server
sets it up (`setup`) and hands it to the checkpointer, which saves and restores its model and optimizer through
`collective` and `on_compute` (`checkpoint.CheckpointedGroup`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hybridrec.core.runtime import log
from hybridrec.core.config import Config
from services.nn_worker.compute import ComputeThread
from services.nn_worker.group.distributed import DenseSync, DistEnv
from services.nn_worker.group.handover import STATS_FIELDS, hand_over
from services.nn_worker.ledger import Ledger
from services.nn_worker.group.membership import Membership, Plan, failure_line, is_group_failure
from services.nn_worker.stats import TrainStats
from services.nn_worker.lr_decay import LrDecay
from services.nn_worker.step import StepMath, make_dense_optimizer

if TYPE_CHECKING:
    from hybridrec.core.layouts.checkpoints import JobManifest

_SKIP = object()


class DenseGroup:
    """Rank `env.rank`'s place in the dense group (module docstring). `membership` None: a lost peer stops this
    rank (the modes whose replicas are not identical after every step)."""

    def __init__(self, config: Config, env: DistEnv, math: StepMath, stats: TrainStats, ledger: Ledger,
                 compute: ComputeThread, membership: Membership | None):
        self.config, self.env, self.math, self.stats, self.ledger = config, env, math, stats, ledger
        self.compute, self.membership = compute, membership
        self.log = log.get()

    @property
    def model(self) -> torch.nn.Module:
        """This rank's replica of the dense model (`StepMath` owns it)."""
        return self.math.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The dense optimizer, once `setup` has built it."""
        return self.math.optimizer

    @property
    def samples_counted(self) -> bool:
        """`Ledger.samples_counted`: False while a replacement has not yet counted its predecessor's share of every
        loader; the checkpointer postpones an interval checkpoint until then."""
        return self.ledger.samples_counted

    async def on_compute(self, fn, *args) -> Any:
        """Run `fn(*args)` on the compute thread. Every torch and torch.distributed call goes through here, so
        collectives are issued in the same order on every rank and no tensor is touched by two threads."""
        return await self.compute.run(fn, *args)

    async def setup(self, plan: Plan) -> Plan:
        """Build the optimizer and wrap the model for dense synchronisation (collectives: on the compute thread).

        With a source in the plan (this process replaces a lost rank), take the model, optimizer and step from
        it; without one, every rank starts alike (and the server then restores the newest checkpoint). Returns
        the plan the group finally formed on (another round if a peer was lost meanwhile)."""
        math = self.math
        math.optimizer = make_dense_optimizer(math.model, self.config)
        math.decay = LrDecay.from_config(self.config)
        while True:
            try:
                if plan.source is not None:
                    await self.on_compute(self._adopt, plan)
                else:
                    math.sync = await self.on_compute(DenseSync, math.model, self.env, self.config.training)
                return plan
            except Exception as exc:  # noqa: BLE001 - a peer was lost while the group formed: join again
                if self.membership is None or not is_group_failure(exc):
                    raise
                self.log.warning("group_failed", step=self.stats.steps, error=failure_line(exc))
                plan = await self.on_compute(self.membership.join, None)

    async def collective(self, fn, *args, after_regroup=_SKIP) -> Any:
        """Run `fn` (which holds collectives) on the compute thread; if the group broke because a peer was lost,
        re-form it with the peer's replacement, hand it our state, and then run `fn` again — or, when
        `after_regroup` is given, return that instead: a replacement starts at the top of a step, so a
        collective that belongs after the step (the time-checkpoint vote, the sync barrier) must not be
        repeated by the survivors alone."""
        while True:
            try:
                return await self.on_compute(fn, *args)
            except Exception as exc:  # noqa: BLE001 - anything but a lost peer is re-raised below
                if self.membership is None or not is_group_failure(exc):
                    raise
                await self.regroup(exc)
                if after_regroup is not _SKIP:
                    return after_regroup

    async def regroup(self, exc: BaseException) -> None:
        """Re-form the group after a lost peer (again, should another be lost during the hand-over)."""
        while True:
            self.log.warning("group_failed", step=self.stats.steps, generation=self.membership.generation,
                             error=failure_line(exc))
            plan = await self.on_compute(self.membership.join, self.stats.steps)
            try:
                await self.on_compute(self._adopt, plan)
                break
            except Exception as again:  # noqa: BLE001 - re-raised unless it is another lost peer
                if not is_group_failure(again):
                    raise
                exc = again
        self.stats.regroups += 1
        self.log.warning("group_reformed", step=self.stats.steps, generation=plan.generation, source=plan.source,
                         replaced=list(plan.joined_fresh))

    def _adopt(self, plan: Plan) -> None:
        """Compute thread, right after a (re)formation with a source: everyone takes its state, then DDP is
        rebuilt on the new group."""
        stats, math = self.stats, self.math
        counters = {**{k: getattr(stats, k) for k in STATS_FIELDS}, "loader_steps": self.ledger.loader_steps}
        handed = hand_over(math.model, math.optimizer, counters, stats.wall_s, plan.source)
        if self.env.rank in plan.joined_fresh:  # a replacement takes over its predecessor's share and place
            loader_steps = [int(n) for n in handed.stats.pop("loader_steps")]
            for key, value in handed.stats.items():
                setattr(stats, key, type(getattr(stats, key))(value))
            stats.wall_offset, stats.started = handed.wall_s, None
            self.take_over(loader_steps)
        math.sync = DenseSync(math.model, self.env, self.config.training, source=plan.source)

    def take_over(self, loader_steps: list[int]) -> None:
        """A replacement of a lost rank: its predecessor's place in each loader's stream (`Ledger.take_over`:
        confirming only what it received, so the loaders send again what the predecessor still owed). The
        source's sample count is not its predecessor's: this rank's share is counted from the streams (rank 0
        holds the restored job total: checkpoint.py), loader by loader as their frames are taken
        (`Trainer._take`)."""
        self.ledger.take_over(loader_steps)
        self.stats.samples = self.stats.restored_samples if self.env.rank == 0 else 0

    def restore_counters(self, manifest: JobManifest) -> None:
        """Take the counters of the checkpoint the group was just restored from (`Checkpointer.restore`, which
        loaded the model and optimizer). Its samples and training time are the job's: rank 0 carries them (the
        ranks' counts are summed at the end), the others start from zero; every rank keeps the job's samples at
        the checkpoint (a replacement's count starts from there)."""
        stats = self.stats
        stats.steps = manifest.step
        stats.samples = manifest.samples if self.env.rank == 0 else 0
        stats.restored_samples = manifest.samples
        stats.wall_offset = manifest.train_wall_s if self.env.rank == 0 else 0.0
