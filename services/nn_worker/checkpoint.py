"""On the NN workers: synchronised job checkpoints, and resuming from the newest one.

The trainer calls `maybe_save` after every step, and the checkpointer decides
whether to write one: every `checkpoint.interval_steps` steps, and when
`checkpoint.interval_s` seconds have passed since the last one (the ranks agree
on that every `AGREE_EVERY` steps with a one-element AllReduce, so all of them
checkpoint at the same step). Then all ranks drain their gradient pushes
and meet at a barrier, so the PS holds exactly the updates of every batch
trained so far. Rank 0 then writes the dense model and optimizer, has every PS
shard dump its rows at that step, and records, per data loader, the data
position after the last consumed batch of its stream (gathered from the rank
that trained it). The manifest is
written last and the directory renamed into place, so a crash mid-checkpoint
leaves the previous checkpoint as the newest complete one.

When training ends, with `checkpoint.dir` set and `checkpoint.final` on (with
or without an interval), the ranks write one more, final checkpoint the same
way: after every gradient push is acknowledged and before evaluation, so it
holds exactly the model that is evaluated. Every checkpoint carries the job's
resolved `config.yaml`, so `hybridrec export` can turn it into a model bundle
on its own.

A restarted group (after any NN worker or the data loader died) calls
`restore` before serving: all ranks load the dense state, rank 0 has the PS
shards load their rows, and the data loader reads the same manifest to resume
reading where the checkpoint stopped. Rows the PS created after the checkpoint
are kept (an extra, harmless update, as the Persia paper allows for embeddings).
"""
from __future__ import annotations

import asyncio
import copy
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

import torch
import torch.distributed as dist

from hybridrec.core.layouts import checkpoints
from hybridrec.core.runtime import log, rpc
from hybridrec.core.layouts.checkpoints import JobManifest
from hybridrec.core.config import Config, ConfigError, Mode, dump_config
from hybridrec.core.wire.proto import pb
from services.nn_worker.group.distributed import barrier, control_group
from services.nn_worker.stats import TrainStats


PS_TIMEOUT_S = 600.0
AGREE_EVERY = 10
"""Steps between the ranks' agreements on whether the time interval is up."""
MAX_OVERHEAD = 0.05
"""Time checkpoints take at most this share of training: the interval stretches with their duration."""
UNCOUNTED = -1
"""A rank's sample count in the position gather while it is not yet the job's: a replacement that has not
taken a batch or end of every loader (`Ledger.take_over`). An interval checkpoint is then postponed to the next
interval rather than written with too few samples."""


class CheckpointedGroup(Protocol):
    """What the checkpointer uses of the dense group (`services.nn_worker.group.dense_group.DenseGroup`), which
    the trainer and the server hand to each of its collective calls (`maybe_save`, `save`, `finish`, `restore`):
    the checkpointer is built before it and holds no reference to it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    stats: TrainStats  # read only: `samples` and `wall_s` go into the manifest
    samples_counted: bool  # False while a replacement has not yet counted its predecessor's share of every loader

    async def on_compute(self, fn, *args) -> Any: ...

    async def collective(self, fn, *args, after_regroup: Any = ...) -> Any: ...

    def restore_counters(self, manifest: JobManifest) -> None: ...


class Checkpointer:
    """Takes the whole config, not only its `checkpoint` section: every checkpoint carries the job's resolved
    config (for `hybridrec export`), and it needs the PS addresses and the training mode."""

    def __init__(self, config: Config, rank: int, world_size: int):
        self.root = config.checkpoint.dir
        self.interval = config.checkpoint.interval_steps
        self.interval_s = config.checkpoint.interval_s
        self.last_time = time.monotonic()  # end of the last checkpoint, or the start
        self.last_cost_s = 0.0  # how long the last checkpoint took
        self.keep, self.resume = config.checkpoint.keep, config.checkpoint.resume
        self.rank, self.world_size, self.num_ps = rank, world_size, len(config.cluster.ps)
        self.ps_addresses = config.cluster.ps
        self.config = config
        self.final = config.checkpoint.final
        self.log = log.get()
        self.last_saved: int | None = None  # step of the newest checkpoint this group wrote
        self.restored_step: int | None = None  # step of the checkpoint this group resumed from
        self.loaders = len(config.cluster.dataloader)
        self.resumed_at: list[tuple[int, tuple[int, ...]]] = [(-1, (0, 0, 0, 0))] * self.loaders
        """Per data loader, (seq, position) of the last batch of its stream in the restored checkpoint."""
        self.final_path: Path | None = None
        self.final_s: float | None = None

    async def maybe_save(self, group: CheckpointedGroup, step: int, last: list[tuple[int, tuple[int, ...]]],
                         before_write: Callable[[], Awaitable[None]]) -> None:
        """Collective, after every training step: write a checkpoint of `step` when one is due (`due`, or the
        ranks agree the time interval is up: `time_up`, asked every `AGREE_EVERY` steps), first awaiting
        `before_write` (the trainer's pushes drained: the PS must hold every update up to this step)."""
        if self.due(step) or (self.asks_time(step) and await group.collective(self.time_up, after_regroup=False)):
            await before_write()
            await self.save(group, step, last)

    def due(self, step: int) -> bool:
        """The step trigger (the same on every rank without asking)."""
        return bool(self.root and self.interval) and step % self.interval == 0

    def asks_time(self, step: int) -> bool:
        """Whether the ranks ask each other at this step if the time interval is up (`time_up`)."""
        return bool(self.root and self.interval_s) and step % AGREE_EVERY == 0

    def time_up(self) -> bool:
        """Collective, on the compute thread: True on every rank when any rank's interval is up."""
        interval = max(self.interval_s, self.last_cost_s * (1 - MAX_OVERHEAD) / MAX_OVERHEAD)
        flag = torch.tensor([int(time.monotonic() - self.last_time >= interval)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
        return bool(flag.item())

    async def finish(self, group: CheckpointedGroup, step: int, last: list[tuple[int, tuple[int, ...]]]) -> None:
        """Collective, at the end of training (pushes drained, `DenseSync.finish` done): the final checkpoint.

        Not written again when a checkpoint of this step already holds the final
        state: the one this group resumed from (every rank loaded it, so the
        replicas are identical), or an interval checkpoint of the last step in a
        mode whose replicas are always identical (hybrid, sync). `final_path`
        names the checkpoint either way; `final_s` is set when one was written.
        """
        if not (self.root and self.final):
            return
        identical = self.config.training.mode in (Mode.HYBRID, Mode.SYNC)
        if step == self.restored_step or (step == self.last_saved and identical):
            self.final_path = checkpoints.step_dir(self.root, step)
            return
        started = time.monotonic()
        await self.save(group, step, last, survive_peer_loss=False)
        self.final_s = time.monotonic() - started
        self.final_path = checkpoints.step_dir(self.root, step)
        self.log.info("final_checkpoint_written", step=step, directory=str(self.final_path),
                      seconds=round(self.final_s, 3))

    async def _ps(self, method: str, directory: Path, step: int,
                  base: int | None = None) -> list[pb.CheckpointReply]:
        """Have every PS shard dump into / load from `directory`, named relative to the shared checkpoint root.
        `base`: the newest complete checkpoint, which each shard's dump may build on (a delta)."""
        request = pb.CheckpointRequest(name=directory.name, step=step, base=base)

        async def one(address: str) -> pb.CheckpointReply:
            async with rpc.channel(address) as ch:
                call = rpc.control_method(ch, "EmbeddingPS", method)
                return await rpc.retry(lambda: call(request, timeout=PS_TIMEOUT_S), deadline_s=PS_TIMEOUT_S)

        return await asyncio.gather(*(one(a) for a in self.ps_addresses))

    async def save(self, group: CheckpointedGroup, step: int, last: list[tuple[int, tuple[int, ...]]], *,
                   survive_peer_loss: bool = True) -> None:
        """Collective: every rank calls it at the same step, after draining its gradient pushes. `last`: per
        data loader, the (seq, position) of the newest batch of its stream this rank trained.

        With `survive_peer_loss` (interval checkpoints), a peer lost during the checkpoint's collectives is
        replaced like one lost in a training step (`DenseGroup.collective`): the group re-forms, the replacement
        starts at the next step, and this checkpoint is skipped (lost before rank 0 wrote it) or kept (lost
        after). Without it (the final checkpoint, which the ranks reach past their last step, where a
        replacement could not join them), the loss stops this rank and the group goes back to a checkpoint."""
        started = time.monotonic()
        meet = ((lambda fn, *args: group.collective(fn, *args, after_regroup=False)) if survive_peer_loss
                else group.on_compute)
        counted = group.samples_counted or not survive_peer_loss
        gathered = await meet(self._gather_position, last, group.stats.samples if counted else UNCOUNTED)
        if gathered is False:
            self.log.warning("checkpoint_skipped", step=step, reason="a peer was lost and replaced")
            return
        newest, samples = gathered
        if samples is None:  # every rank sees it: the gather is the same everywhere; the next interval's is tried
            self.log.warning("checkpoint_postponed", step=step,
                             reason="a replacement has not yet counted its predecessor's samples")
            return
        if self.rank == 0:
            await self._write(group, step, newest, samples)
        if await meet(barrier) is False:  # rank 0 may not have finished it: not counted as this step's
            self.log.warning("checkpoint_unconfirmed", step=step, reason="a peer was lost and replaced")
            return
        self.last_saved = step
        self.last_time = time.monotonic()
        self.last_cost_s = self.last_time - started

    async def _write(self, group: CheckpointedGroup, step: int, newest: list[tuple[int, tuple[int, ...]]],
                     samples: int) -> None:
        """Rank 0: the dense state, every PS shard's rows and the manifest, renamed into place last."""
        final = checkpoints.step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        await group.on_compute(self._save_dense, tmp / checkpoints.DENSE, group.model, group.optimizer)
        dump_config(self.config, tmp / checkpoints.CONFIG)
        files = await asyncio.get_running_loop().run_in_executor(None, self._seal, tmp)
        replies = await self._ps("Checkpoint", tmp, step, base=self.last_saved)
        chain = sorted({int(s) for reply in replies for s in reply.chain} - {step})
        streams = [(seq + 1, list(position)) for seq, position in newest]
        checkpoints.write_manifest(tmp, JobManifest.of_streams(
            streams, step=step, samples=samples, train_wall_s=group.stats.wall_s, num_nn_workers=self.world_size,
            num_ps=self.num_ps, chain=chain, files=files))
        checkpoints.publish(tmp, final)
        deleted = checkpoints.prune(self.root, self.keep)
        self.log.info("checkpoint_written", step=step, directory=str(final), seq=[seq for seq, _ in streams],
                      ps_bytes=sum(reply.bytes for reply in replies), builds_on=chain, pruned=deleted)

    def _gather_position(self, last: list[tuple[int, tuple[int, ...]]],
                         samples: int) -> tuple[list[tuple[int, tuple[int, ...]]], int | None]:
        """Per data loader, the (seq, position) of the latest batch of its stream any rank trained: where that
        loader resumes; and the samples the group trained, summed over the ranks (they differ: a file's last
        batch is short, and which rank gets it depends on the stream, so rank 0's count times N is not the
        job's), or None when a rank's is `UNCOUNTED`. `last` and `samples`: this rank's."""
        mine = torch.tensor([v for seq, position in last for v in (seq, *(list(position) + [0, 0, 0, 0])[:4])]
                            + [samples], dtype=torch.int64)
        parts = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=control_group())
        newest = []
        for loader in range(len(last)):
            best = max((t[5 * loader:5 * loader + 5] for t in parts), key=lambda t: int(t[0]))
            newest.append((int(best[0]), tuple(int(v) for v in best[1:5])))
        counts = [int(t[-1]) for t in parts]
        return newest, (None if UNCOUNTED in counts else sum(counts))

    @staticmethod
    def _seal(tmp: Path) -> dict:
        """Rank 0's files fsynced with their directory, and their sizes and digests for the manifest (off the
        event loop: a large dense model takes a while to hash)."""
        checkpoints.seal(tmp)
        return {name: checkpoints.file_entry(tmp / name) for name in (checkpoints.DENSE, checkpoints.CONFIG)}

    @staticmethod
    def _save_dense(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """On the CPU whatever the device: a checkpoint loads on any device, or on none (`hybridrec export`)."""
        torch.save(on_cpu({"model": model.state_dict(), "optimizer": optimizer.state_dict()}), path)

    async def restore(self, group: CheckpointedGroup) -> JobManifest | None:
        """Collective: load the newest checkpoint on every rank (and, from rank 0, on every PS shard); the
        group takes its counters (`restore_counters`)."""
        found = checkpoints.resume_from(self.config.checkpoint)
        if found is None:
            return None
        path, manifest = found
        if manifest.num_nn_workers != self.world_size:
            raise ValueError(f"checkpoint {path} was written by {manifest.num_nn_workers} NN workers; this job "
                             f"has {self.world_size}")
        checkpoints.check_loaders(path, manifest, self.loaders)
        await group.on_compute(load_dense, path / checkpoints.DENSE, group.model, group.optimizer)
        if self.rank == 0:
            await self._ps("LoadCheckpoint", path, manifest.step)
        await group.on_compute(barrier)
        group.restore_counters(manifest)
        self.restored_step = manifest.step
        self.resumed_at = [(seq - 1, tuple(position)) for seq, position in manifest.streams()]
        self.log.info("checkpoint_restored", step=manifest.step, directory=str(path),
                      seq=[seq for seq, _ in manifest.streams()])
        return manifest


def on_cpu(state: Any) -> Any:
    """`state` (nested dicts and lists of tensors and values, a state_dict) with every tensor copied to the CPU."""
    if torch.is_tensor(state):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: on_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(value) for value in state)
    return state


def load_dense(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's dense state into `model` and `optimizer`, wherever they live.

    Read onto the CPU (`map_location`: a file written by a GPU worker, or by an older version that saved CUDA
    tensors, loads on a CPU worker or another GPU); `load_state_dict` copies each tensor to its parameter's
    device. A file of another model is refused naming it (a usage error: exit 2, not a restart loop)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, OSError) as exc:  # `latest` skips such a checkpoint: not its own
        raise ValueError(f"checkpoint {path}: the dense state does not load ({str(exc).splitlines()[0]})") from exc
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"checkpoint {path} does not fit this job's dense model (checkpoint.dir holds another "
                          f"model's checkpoint?): {str(exc).splitlines()[0]}") from exc


def check_resumable(config: Config, model: torch.nn.Module, make_optimizer) -> None:
    """Before the group forms: the checkpoint this job would resume from loads into this model and its
    optimizer (tried on copies), else ConfigError naming the file. Every rank refuses it alike here, before
    any collective, rather than one failing in `restore` while its peer waits in a collective and sees it
    vanish (a lost peer, which a supervisor replaces)."""
    found = checkpoints.resume_from(config.checkpoint)
    if found is None:
        return
    checkpoints.check_loaders(found[0], found[1], len(config.cluster.dataloader))
    scratch = copy.deepcopy(model)
    load_dense(found[0] / checkpoints.DENSE, scratch, make_optimizer(scratch, config))
