"""`hybridrec serve nn_worker`: rank r of the synchronous dense group.

Receives dense batches from the data loader (a bounded inbox: back-pressure on
the loader), trains through `Trainer`, evaluates, and — on rank 0 — writes the
run's results to output.dir/summary.json. The process exits 0 when it is done,
which is how the launcher, Compose and a Kubernetes Job see completion.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
import torch.distributed as dist

from hybridrec import codec, rpc
from hybridrec.batch import DenseBatch, worker_of_ref
from hybridrec.config import Config
from hybridrec.evaluation import binary_metrics, find_oracle
from hybridrec.files import write_json_atomic
from hybridrec.models import FeatureInfo, build_model
from hybridrec.proto import pb
from hybridrec.rpc import Unavailable
from hybridrec.service import ServiceHost
from services.nn_worker.checkpoint import Checkpointer
from services.nn_worker.distributed import init_process_group
from services.nn_worker.trainer import BatchLost, EndOfPhase, Trainer



class NNWorkerServicer:
    def __init__(self, config: Config, replica: int, inbox: asyncio.Queue):
        self.config, self.replica, self.inbox = config, replica, inbox
        self.trainer: Trainer | None = None
        self.phase = "starting"

    async def PutBatch(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        frame = codec.decode(request)
        end_of = frame.meta.get("end_of")
        if end_of is not None:
            if end_of not in ("train", "eval"):
                raise ValueError(f"end_of must be 'train' or 'eval', got {end_of!r}")
            await self.inbox.put(EndOfPhase(end_of, {k: v for k, v in frame.meta.items() if k != "end_of"}))
        else:
            await self.inbox.put(DenseBatch.decode(frame, self.config.num_dense))
        return codec.encode()

    async def Status(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.TrainingStatus:
        stats = self.trainer.stats if self.trainer else None
        if stats is None:
            return pb.TrainingStatus(phase=self.phase)
        return pb.TrainingStatus(done=self.phase == "done", step=stats.steps, samples=stats.samples,
                                 loss=stats.last_loss, phase=self.phase, train_auc=stats.train_auc,
                                 samples_per_sec=stats.samples / stats.wall_s if stats.wall_s else 0.0)

    def stats(self) -> dict[str, float]:
        values = {"inbox_batches": float(self.inbox.qsize())}
        if self.trainer:
            s = self.trainer.stats
            values.update(steps_total=s.steps, samples_total=s.samples, loss=s.last_loss, train_auc=s.train_auc,
                          samples_per_sec=s.samples / s.wall_s if s.wall_s else 0.0,
                          batches_in_flight=self.trainer.in_flight, lost_updates_total=s.pushes_failed,
                          skipped_batches_total=s.skipped_batches)
        return {k: float(v) for k, v in values.items()}

    async def Stats(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.ServiceStats:
        return pb.ServiceStats(service="nn_worker", replica=self.replica, values=self.stats())


def _gather_eval(preds: np.ndarray, labels: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's predictions and labels, on every rank (padded all_gather: no pickled objects)."""
    local = torch.from_numpy(np.stack([preds, labels]).astype(np.float32))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([local.shape[1]]))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(2, longest)
    padded[:, :local.shape[1]] = local
    parts = [torch.zeros(2, longest) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    joined = torch.cat([p[:, :int(n.item())] for p, n in zip(parts, sizes)], dim=1).numpy()
    return joined[0], joined[1]


def _reduce_stats(trainer: Trainer) -> dict:
    s = trainer.stats
    totals = torch.tensor([s.samples, s.steps, s.pushes_failed, s.loss_sum, s.loss_count, s.skipped_batches,
                           s.skipped_eval_batches], dtype=torch.float64)
    dist.all_reduce(totals)
    hist = torch.from_numpy(s.staleness_hist.astype(np.int64))
    dist.all_reduce(hist)
    wall = torch.tensor([s.wall_s], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return {"samples": int(totals[0]), "steps": int(totals[1]) // trainer.env.world_size,
            "lost_updates": int(totals[2]), "mean_train_loss": float(totals[3] / max(totals[4].item(), 1)),
            "train_wall_s": float(wall[0]), "staleness_hist": hist.tolist(), "skipped_batches": int(totals[5]),
            "skipped_eval_batches": int(totals[6])}


def _staleness_summary(hist: list[int]) -> dict:
    counts = np.asarray(hist, dtype=np.int64)
    if counts.sum() == 0:
        return {"p50": 0, "max": 0, "histogram": hist}
    cdf = np.cumsum(counts) / counts.sum()
    return {"p50": int(np.searchsorted(cdf, 0.5)), "max": int(np.nonzero(counts)[0].max()), "histogram": hist}


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


async def serve(config: Config, replica: int) -> None:
    started = time.monotonic()
    host = ServiceHost("nn_worker", config, replica)
    world_size = len(config.cluster.nn_workers)
    torch.set_num_threads(config.training.torch_threads)
    torch.manual_seed(config.training.seed)
    inbox: asyncio.Queue = asyncio.Queue(maxsize=config.training.prefetch + 2)
    servicer = NNWorkerServicer(config, replica, inbox)
    host.add(servicer, servicer.stats)

    channels = [rpc.channel(a) for a in config.cluster.embedding_workers]
    lookups = [rpc.raw_method(ch, "EmbeddingWorker", "Lookup") for ch in channels]
    pushes = [rpc.raw_method(ch, "EmbeddingWorker", "PushGradients") for ch in channels]
    timeout = config.cluster.rpc_timeout_s

    def worker_of(ref: int) -> int:
        index = worker_of_ref(ref)
        if index >= len(channels):
            raise ValueError(f"batch_ref {ref} names embedding worker {index}, which does not exist")
        return index

    retry_s = config.cluster.retry_s

    async def call(methods, ref: int, frame: bytes) -> bytes:
        try:
            return await rpc.retry(lambda: methods[worker_of(ref)](frame, timeout=timeout), deadline_s=retry_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise BatchLost(exc.details()) from None
            raise Unavailable(f"embedding worker call for batch_ref {ref} failed: {exc.code().name} "
                              f"{exc.details()}") from None

    async def lookup(ref: int) -> bytes:
        return await call(lookups, ref, codec.encode(meta={"batch_ref": ref}))

    async def push(ref: int, frame: bytes) -> int:
        return codec.decode(await call(pushes, ref, frame)).meta_int("applied", default=0)

    await host.start()
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    loop = asyncio.get_running_loop()
    env = await loop.run_in_executor(compute, lambda: init_process_group(
        rendezvous=config.cluster.rendezvous, rank=replica, world_size=world_size, backend=config.training.backend,
        timeout_s=config.cluster.start_timeout_s * 5))
    host.log.info("process_group_ready", backend=env.backend, device=str(env.device), world_size=world_size)
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features],
                        config.num_dense, config.model.kwargs)
    trainer = Trainer(config, env, model, lookup, push, inbox, compute)
    await trainer.setup()
    trainer.checkpointer = Checkpointer(config, replica, world_size, trainer)
    await trainer.checkpointer.restore()
    servicer.trainer = trainer
    await rpc.wait_until_serving(config.cluster.embedding_workers, timeout_s=config.cluster.start_timeout_s,
                                 what="embedding workers")
    await host.set_serving(True)

    async def main() -> None:
        servicer.phase = "train"
        end_train = await trainer.train()
        host.log.info("train_done", steps=trainer.stats.steps, samples=trainer.stats.samples,
                      wall_s=round(trainer.stats.wall_s, 2))
        servicer.phase = "eval"
        preds, labels, end_eval = await trainer.evaluate()
        all_preds, all_labels = await loop.run_in_executor(compute, _gather_eval, preds, labels, world_size)
        totals = await loop.run_in_executor(compute, _reduce_stats, trainer)
        if replica == 0:
            summary = {
                "mode": config.training.mode.value, "nn_workers": world_size,
                "steps": totals["steps"], "samples": totals["samples"], "train_wall_s": totals["train_wall_s"],
                "samples_per_sec": totals["samples"] / totals["train_wall_s"] if totals["train_wall_s"] else 0.0,
                "mean_train_loss": totals["mean_train_loss"], "lost_updates": totals["lost_updates"],
                "skipped_batches": totals["skipped_batches"], "skipped_eval_batches": totals["skipped_eval_batches"],
                "staleness": _staleness_summary(totals["staleness_hist"]),
                "eval_samples": int(all_labels.shape[0]), **binary_metrics(all_labels, all_preds),
                "oracle_auc": find_oracle(config), "wall_s": time.monotonic() - started,
                "data": {"train": end_train, "eval": end_eval},
            }
            _write_json(Path(config.output.dir) / "summary.json", summary)
            torch.save(trainer.model.state_dict(), Path(config.output.dir) / "dense_model.pt")
            host.log.info("summary_written", auc=summary["auc"], logloss=summary["logloss"])
        await loop.run_in_executor(compute, dist.barrier)
        servicer.phase = "done"

    try:
        await host.run_until_stopped(asyncio.ensure_future(main()))
    finally:
        for ch in channels:
            await ch.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        compute.shutdown(wait=False, cancel_futures=True)
