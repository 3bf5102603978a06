"""On the NN workers, after evaluation: every rank's predictions and counters combined into the run summary.

Collectives only (all_gather / all_reduce of CPU tensors on the control group:
nothing pickled), run on the compute thread by every rank in the same order; rank 0 builds the
`RunSummary`, adding what the embedding workers and PS shards recovered from
restarts (their Stats counters).
"""
from __future__ import annotations

import math
import time

import grpc
import numpy as np
import torch
import torch.distributed as dist

from hybridrec.core.runtime import log, rpc
from hybridrec.core.config import Config
from hybridrec.core.model.evaluation import find_oracle, find_task_oracles
from hybridrec.core.wire.proto import pb
from hybridrec.core.model.tasks import Tasks
from hybridrec.core.layouts.summary import (DiskTierSummary, PublishSummary, RunSummary, Staleness, StoreLoss,
                               TableLifecycle,
                               TaskMetrics)
from services.nn_worker.group.distributed import control_group
from services.nn_worker.progressive import ProgressiveWindow, WindowMetrics, task_metrics
from services.nn_worker.trainer import Trainer


def gather_eval(preds: np.ndarray, labels: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's predictions and labels, on every rank (padded all_gather: no pickled objects). Each keeps
    its shape's kind: (n,) arrays with one column, (n, columns) with several (labels: tasks, then weights)."""
    n = preds.shape[0]
    tasks = 1 if preds.ndim == 1 else preds.shape[1]
    columns = 1 if labels.ndim == 1 else labels.shape[1]
    local = torch.from_numpy(np.concatenate([preds.reshape(n, tasks).T, labels.reshape(n, columns).T])
                             .astype(np.float32))
    rows = tasks + columns
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([local.shape[1]]), group=control_group())
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(rows, longest)
    padded[:, :local.shape[1]] = local
    parts = [torch.zeros(rows, longest) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=control_group())
    joined = torch.cat([p[:, :int(n.item())] for p, n in zip(parts, sizes)], dim=1).numpy()
    all_preds = joined[0] if preds.ndim == 1 else joined[:tasks].T
    return all_preds, joined[tasks] if labels.ndim == 1 else joined[tasks:].T


def reduce_window(window: ProgressiveWindow) -> list[WindowMetrics]:
    """Every task's progressive-validation metrics over every rank's window: the ranks' histograms and loss sums
    added up (an all_reduce of a few MB, not the predictions)."""
    counts = torch.from_numpy(window.counts.copy())
    losses = torch.from_numpy(window.loss_sums())
    dist.all_reduce(counts, group=control_group())
    dist.all_reduce(losses, group=control_group())
    return task_metrics(counts.numpy(), losses.numpy())


def reduce_stats(trainer: Trainer) -> dict:
    """Training counters summed (steps: per rank; wall time: the longest rank) over the group."""
    s = trainer.stats
    totals = torch.tensor([s.samples, s.steps, s.pushes_failed, s.loss_sum, s.loss_count, s.skipped_batches,
                           s.skipped_eval_batches], dtype=torch.float64)
    dist.all_reduce(totals, group=control_group())
    hist = torch.from_numpy(s.staleness_hist.astype(np.int64))
    dist.all_reduce(hist, group=control_group())
    # Longest rank's training time; the first rank's first step and the last rank's end as Unix times
    # (negated start: one MAX reduction). A rank that trained nothing contributes -inf.
    now_epoch, now = time.time(), time.monotonic()
    start = now_epoch - (now - s.started) if s.started is not None else math.inf
    end = now_epoch - (now - (s.finished or now)) if s.started is not None else -math.inf
    wall = torch.tensor([s.wall_s, -start, end, s.nonfinite_steps], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=control_group())
    first, last = -float(wall[1]), float(wall[2])
    waits = torch.tensor([s.exposed_wait_s, s.compute_s, s.compute_cpu_s], dtype=torch.float64)  # summed
    dist.all_reduce(waits, group=control_group())
    rank_steps = max(s.steps, 1) * trainer.env.world_size
    return {"samples": int(totals[0]), "steps": int(totals[1]) // trainer.env.world_size,
            "lost_updates": int(totals[2]), "mean_train_loss": float(totals[3] / max(totals[4].item(), 1)),
            "train_wall_s": float(wall[0]), "staleness_hist": hist.tolist(), "skipped_batches": int(totals[5]),
            "skipped_eval_batches": int(totals[6]), "nonfinite_steps": int(wall[3]),  # the ranks agree (or: the most)
            "train_started_at": first if math.isfinite(first) else None,
            "train_ended_at": last if math.isfinite(last) else None,
            "exposed_wait_per_step_s": float(waits[0]) / rank_steps, "compute_per_step_s": float(waits[1]) / rank_steps,
            "compute_cpu_s": float(waits[2])}


_SERVICES = {"embedding_workers": "EmbeddingWorker", "ps": "EmbeddingPS"}


def _all_stats(config: Config, timeout_s: float) -> dict[str, list[pb.RecoveryStats] | None]:
    """Every embedding worker's and PS shard's typed `RecoveryStats`, asked all at once; None for a service
    with a replica that did not answer within `timeout_s` (a sum without it would understate)."""
    channels, pending = [], {}
    try:
        for key, service in _SERVICES.items():
            calls = []
            for address in getattr(config.cluster, key):
                channels.append(channel := rpc.sync_channel(address))
                stats = channel.unary_unary(f"/hybridrec.{service}/Stats",
                                            request_serializer=pb.Empty.SerializeToString,
                                            response_deserializer=pb.ServiceStats.FromString)
                calls.append(stats.future(pb.Empty(), timeout=timeout_s))
            pending[key] = calls
        out: dict[str, list[pb.RecoveryStats] | None] = {}
        for key, calls in pending.items():
            try:
                out[key] = [call.result().recovery for call in calls]
            except grpc.RpcError as exc:
                log.get().warning("service_stats_unavailable", service=key, error=str(exc))
                out[key] = None
        return out
    finally:
        for channel in channels:
            channel.close()


def recovery_counters(config: Config, *, timeout_s: float = 5.0) -> dict:
    """What restarted services recovered during the run, and what the PS holds at its end, from every embedding
    worker's and PS shard's typed Stats: `batches_recovered` and `unapplied_updates` (embedding workers),
    `updates_deduplicated`, `ps_rows` and per-table `lifecycle` (PS shards). A field is None when a replica of
    its service did not answer within `timeout_s`."""
    stats = _all_stats(config, timeout_s)
    workers = stats["embedding_workers"]
    out: dict = {
        "batches_recovered": None if workers is None else sum(w.batches_recovered for w in workers),
        "unapplied_updates": None if workers is None else sum(w.unapplied_train_batches for w in workers),
    }
    out.update(ps_totals(stats["ps"]))
    out.update(store_losses(workers, stats["ps"]))
    return out


def store_losses(workers: list[pb.RecoveryStats] | None, shards: list[pb.RecoveryStats] | None) -> dict:
    """`shards_restored`, `store_losses` and their lost updates: for each life of a shard that lost its store,
    the updates it acknowledged to the embedding workers minus those applied when the checkpoint its successor
    restored was written (services/embedding_ps/lives.py)."""
    losses = [loss for shard in shards or [] for loss in shard.losses]
    if not losses:
        return {"shards_restored": 0, "store_losses": None, "updates_lost_with_stores": 0}
    acks: dict[tuple[int, int], int] = {}
    for worker in workers or []:
        for ack in worker.acks:
            acks[(ack.shard, ack.life)] = acks.get((ack.shard, ack.life), 0) + int(ack.updates)
    out = []
    for loss in losses:
        acknowledged = acks.get((loss.shard, loss.life), 0)
        out.append(StoreLoss(shard=loss.shard, life=str(loss.life), restored_step=loss.restored_step,
                             acknowledged=acknowledged, applied_at_checkpoint=loss.applied_at_checkpoint,
                             lost=max(acknowledged - loss.applied_at_checkpoint, 0), from_replica=loss.from_replica))
    return {"shards_restored": len(out), "store_losses": out, "updates_lost_with_stores": sum(x.lost for x in out)}


def ps_totals(shards: list[pb.RecoveryStats] | None) -> dict:
    """`updates_deduplicated`, `ps_rows`, per-table `lifecycle` and `disk_tier` of the summary from every PS shard's
    `RecoveryStats` (None: a shard did not answer)."""
    if shards is None:
        return {"updates_deduplicated": None, "ps_rows": None, "lifecycle": None, "disk_tier": None}
    tables: dict[int, dict[str, int]] = {}
    for shard in shards:
        for table in shard.tables:
            counters = tables.setdefault(table.group, {})
            for name in TableLifecycle.model_fields:
                counters[name] = counters.get(name, 0) + int(getattr(table, name))
    return {"updates_deduplicated": sum(s.updates_deduplicated for s in shards),
            "ps_rows": sum(sum(s.rows_by_width.values()) for s in shards),
            "lifecycle": {g: TableLifecycle(**c) for g, c in sorted(tables.items())},
            "disk_tier": disk_tier_totals(shards)}


def disk_tier_totals(shards: list[pb.RecoveryStats]) -> DiskTierSummary | None:
    """The summary's `disk_tier`: every shard's TierStats summed (None: no shard has a disk tier)."""
    tiers = [s.tier for s in shards if s.HasField("tier")]
    if not tiers:
        return None
    total = {f: sum(getattr(t, f) for t in tiers) for f in pb.TierStats.DESCRIPTOR.fields_by_name}
    lookups, misses = total.pop("lookups"), total.pop("misses")
    return DiskTierSummary(**total, memory_hit_rate=round(1 - misses / lookups, 6) if lookups else None)


def build_summary(config: Config, totals: dict, labels: np.ndarray, preds: np.ndarray, *, started: float,
                  data: dict, publish: PublishSummary | None = None,
                  progressive: list[WindowMetrics] | None = None) -> RunSummary:
    """Rank 0's summary of the run from the reduced counters and every rank's eval predictions, and the
    recovery and lifecycle counters of the embedding workers and PS shards (Stats RPCs: a few milliseconds).
    `progressive`: each task's progressive-validation metrics over every rank's window (`reduce_window`)."""
    wall = totals["train_wall_s"]
    every = _task_metrics(config, labels, preds, progressive)
    first = every[0].model_dump(include={"auc", "logloss", "calibration", "rmse", "mae", "oracle_rmse"})
    tasks = every if len(every) > 1 else None
    recovered = recovery_counters(config)
    # The embedding workers keep a looked-up training batch until its update is applied, so what they still
    # hold now is every lost update — including pushes lost with an NN worker that died, which no surviving
    # NN worker counted. Without every worker's answer, the NN workers' own count of failed pushes stands.
    unapplied = recovered.pop("unapplied_updates")
    lost = (unapplied if unapplied is not None else totals["lost_updates"]) + recovered.pop("updates_lost_with_stores")
    return RunSummary(
        mode=config.training.mode.value, nn_workers=len(config.cluster.nn_workers),
        steps=totals["steps"], samples=totals["samples"], train_wall_s=wall,
        samples_per_sec=totals["samples"] / wall if wall else 0.0,
        mean_train_loss=totals["mean_train_loss"], lost_updates=lost,
        skipped_batches=totals["skipped_batches"], skipped_eval_batches=totals["skipped_eval_batches"],
        nonfinite_steps=totals.get("nonfinite_steps", 0),
        staleness=Staleness.from_histogram(totals["staleness_hist"]),
        exposed_wait_per_step_s=totals["exposed_wait_per_step_s"], compute_per_step_s=totals["compute_per_step_s"],
        compute_cpu_s=totals["compute_cpu_s"], eval_samples=int(labels.shape[0]), **first, tasks=tasks,
        oracle_auc=find_oracle(config) if tasks is None and every[0].kind == "binary" else every[0].oracle_auc,
        wall_s=time.monotonic() - started, data=data,
        train_started_at=totals.get("train_started_at"), train_ended_at=totals.get("train_ended_at"),
        publish=publish, ps_storage=str(config.ps.storage),
        **_progressive(progressive if every[0].kind == "binary" else None),
        **recovered,
    )


def _progressive(window: list[WindowMetrics] | None) -> dict:
    """The summary's progressive-validation fields: the first task's at the top, every task's in `tasks`."""
    if not window or not window[0].samples:
        return {"progressive_auc": None, "progressive_samples": 0}
    first = window[0]
    known = first.auc == first.auc
    return _window_fields(first) | {"progressive_auc_bound": first.auc_bound if known else None,
                                    "progressive_samples": first.samples}


def _task_metrics(config: Config, labels: np.ndarray, preds: np.ndarray,
                  window: list[WindowMetrics] | None = None) -> list[TaskMetrics]:
    """Each task's eval metrics by its kind (weighted by the weight column, when there is one), its oracle and,
    for a binary task, its progressive validation."""
    tasks = Tasks.from_config(config, load=False)
    task_labels, weights = tasks.split(labels)
    task_labels, preds = task_labels.reshape(len(preds), -1), preds.reshape(len(preds), -1)
    oracles = find_task_oracles(config) if tasks.count > 1 or not tasks.specs[0].binary else {}
    out = []
    for t, spec in enumerate(tasks.specs):
        oracle = {k: v for k, v in oracles.get(spec.name, {}).items() if k in ("oracle_auc", "oracle_rmse")}
        out.append(TaskMetrics(name=spec.name, kind=spec.kind, **tasks.metrics(t, task_labels[:, t], preds[:, t],
                                                                               weights),
                               **oracle, **(_window_fields(window[t] if window else None) if spec.binary else {})))
    return out


def _window_fields(metrics: WindowMetrics | None) -> dict:
    if metrics is None or not metrics.samples:
        return {}
    return {"progressive_auc": metrics.auc if metrics.auc == metrics.auc else None,
            "progressive_logloss": metrics.logloss}
