"""`hybridrec serve embedding_ps`: one PS shard — a store per embedding width behind gRPC.

Requests are decoded on the event loop (cheap, zero-copy) and the store's
compiled kernels run on a small thread pool: they release the GIL, so lookups
and updates of concurrent requests use several cores while the loop keeps
accepting RPCs.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.runtime.lazy_torch import import_torch_in_background, imported
from hybridrec.core.config import Config
from hybridrec.core.layouts import checkpoints
from hybridrec.core.runtime import log, rpc
from hybridrec.core.layouts.checkpoints import resolve_under
from hybridrec.core.wire.frames import Applied, PSLookup, PSRows, PSUpdate, ShardPull, ShardRows, max_ids
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime.rpc import FailedPrecondition
from hybridrec.core.runtime.service import ServiceHost, at_work
from hybridrec.core.wire.sharding import shard_of
from hybridrec.core.layouts.versions import version_dir
from services.embedding_ps import lives
from services.embedding_ps.applied import AppliedLog
from services.embedding_ps.publish import ChangeLog, publish_shard
from services.embedding_ps.replica import Backup, Primary, backup_of, backup_host, open_stores_in, \
    restore_from_backup, row_widths
from services.embedding_ps.store import EmbeddingStore, StoreConfig, shard_tier_dir
from services.embedding_ps.tier import CorruptTier


def shard_dir(config: Config, shard: int) -> Path:
    return Path(config.ps.shm_dir) / f"shard-{shard:05d}"


WARM_UP_PREFIX = "hybridrec-warmup-"
"""A warm-up's scratch store: <ps.shm_dir>/hybridrec-warmup-<pid>-<random>/, inside the run's own directory,
so that whoever removes the run's shared memory removes it too, even after a PS killed while warming up."""


def remove_stale_warm_ups(root: Path) -> list[Path]:
    """Remove the scratch stores of warm-ups whose process is gone (a PS killed while it compiled leaves its
    directory behind: TemporaryDirectory cleans up on exit, not on SIGKILL); returns what was removed."""
    removed = []
    for path in root.glob(f"{WARM_UP_PREFIX}*"):
        pid = path.name[len(WARM_UP_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue  # not ours, or its process still runs
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def warm_up(config: Config, *, updates_first: bool = False) -> None:
    """Compile the store's kernels on a scratch table before reporting SERVING.

    numba compiles on first use (seconds, more on a loaded machine or with a cold
    cache in a fresh container); doing it here keeps that out of the first
    lookups' deadlines.

    `updates_first`: begin with the kernel that inserts new rows (`EmbeddingStore.compile_inserts`) and an update
    of rows the store lacks (the update kernels) instead of the lookups, the checkpoint's and the expiry's. Two
    processes that warm up at once in the two orders compile those two halves side by side on a cold cache
    (about 4 CPU-seconds each for a float32 store), each then loading the other's from it
    (`hybridrec.core.runtime.kernel_cache` has each kernel compiled once): the odd PS shards, and the fork
    server's helper (forkserver_parent.warm_up_ps).
    """
    scratch_root = Path(config.ps.shm_dir)
    scratch_root.mkdir(parents=True, exist_ok=True)
    remove_stale_warm_ups(scratch_root)
    with tempfile.TemporaryDirectory(prefix=f"{WARM_UP_PREFIX}{os.getpid()}-", dir=scratch_root) as scratch:
        for dim in config.dims:
            full = StoreConfig.from_config(config, dim)
            tier = full.ps.tier and full.ps.tier.model_copy(update={"dir": str(Path(scratch) / "tier"),
                                                                    "capacity": 256})
            small = dataclasses.replace(full, ps=full.ps.model_copy(update={
                "capacity": 64, "num_stripes": 2, "tier": tier, "admit_probability": 1.0}))
            store = EmbeddingStore.open(Path(scratch) / f"dim-{dim}", small)
            try:
                _exercise(store, dim, updates_first)
            finally:
                store.close()
    _warm_decoders(config)


def _exercise(store: EmbeddingStore, dim: int, updates_first: bool) -> None:
    """Call every kernel a PS of the store's configuration calls while it trains, checkpoints and serves."""
    ids = np.arange(1, 9, dtype=np.uint64)
    grads = np.zeros((ids.size, dim), np.float32)
    if updates_first:
        store.compile_inserts()
        store.update(ids + np.uint64(100), grads)
    for _ in range(max(store.config.admit_after.values(), default=1)):  # counted until admitted: new rows
        store.lookup(ids, train=True)
    store.lookup(ids, train=False)
    store.expire()  # compiles the sweep when a table has a TTL (returns at once otherwise)
    for _ in store.stream_rows(changed_only=True):  # a checkpoint's kernels
        pass
    store.update(ids, grads)
    store.update(ids + np.uint64(100), grads)  # rows it lacks: their gradients are dropped
    if store.tier is not None:  # a restore's bulk load; an update and a read of rows on disk
        more = np.arange(100, 200, dtype=np.uint64)
        store.load_cold(more, np.zeros((more.size, store.config.row_width), np.float32))
        store.update(more, np.zeros((more.size, dim), np.float32))
        store.peek(more, state=True)


def _warm_decoders(config: Config) -> None:
    """Decode an update as a request arrives (read-only arrays over the request's bytes): its duplicate check
    is a kernel of its own."""
    values = ValueCodec(fp16=config.training.compression.fp16, kappa=config.training.compression.kappa)
    ids = {dim: np.arange(1, 9, dtype=np.uint64) for dim in config.dims}
    grads = {dim: np.zeros((8, dim), np.float32) for dim in config.dims}
    PSUpdate.decode(PSUpdate(ids, grads, 1).encode(values), values, config.dims)


def open_stores(config: Config, shard: int) -> dict[int, EmbeddingStore]:
    return open_stores_in(shard_dir(config, shard), config)


def open_applied(config: Config, shard: int) -> AppliedLog:
    """The shard's record of applied update ids, next to its stores (survives a restart like them)."""
    return AppliedLog.open(shard_dir(config, shard) / "applied")


def open_shard(config: Config, shard: int) -> tuple[dict[int, EmbeddingStore], AppliedLog, list[lives.Loss]]:
    """The shard's stores and applied-update record, restored when the job has trained this shard before and its
    files are gone (services/embedding_ps/lives.py): never an empty table served in a job that trained it.

    Returns the stores, the record and the lives of the shard lost during the job. Without checkpoint.dir and
    checkpoint.job_id there is nothing to know the job by: the files are opened as they are."""
    root, job = config.checkpoint.dir, config.checkpoint.job_id
    try:
        stores = open_stores(config, shard)
    except CorruptTier as exc:
        if not (root and job):
            raise  # nothing to restore from: refused, naming the file
        # Its memory store is opened beside it and would be served with rows missing: the shard starts over and
        # restores from its checkpoints, as after a lost host (the loss is recorded and counted below).
        log.get().error("ps_disk_tier_corrupt", shard=shard, error=str(exc), restores="from the newest checkpoint")
        shutil.rmtree(shard_dir(config, shard), ignore_errors=True)
        shutil.rmtree(shard_tier_dir(shard_dir(config, shard), config), ignore_errors=True)
        stores = open_stores(config, shard)
    applied = open_applied(config, shard)
    if not (root and job):
        return stores, applied, []
    known = lives.read(root, shard, job)
    loss = None
    if known is not None:
        recorded = known.lives[-1].life
        created = [applied.created, *(s.created for s in stores.values())]
        # The recorded life lost some of its files, or a start that never completed (a restore that failed or was
        # killed) left some: nothing of them can be trusted; start over with none.
        if (applied.life == recorded and any(created)) or (applied.life != recorded and not all(created)):
            log.get().error("ps_shard_files_untrusted", shard=shard, directory=str(shard_dir(config, shard)),
                            recorded_life=recorded, life=applied.life)
            _close(stores, applied)
            shutil.rmtree(shard_dir(config, shard))
            stores, applied = open_stores(config, shard), open_applied(config, shard)
        if applied.life != recorded:
            try:
                loss = restore(config, shard, stores, applied, lost=recorded)
            except BaseException:
                _close(stores, applied)
                raise
    record = lives.begin(root, shard, job, applied.life, known, replaced=loss)
    return stores, applied, record.losses


def _close(stores: dict[int, EmbeddingStore], applied: AppliedLog) -> None:
    for store in stores.values():
        store.close()
    applied.close()


def load_part(directory: Path, stores: dict[int, EmbeddingStore], *, shard: int, num_shards: int) -> dict:
    """Load into `stores` the rows of the job checkpoint in `directory` that the job's sharding gives shard
    `shard` of `num_shards` (re-sharded when the checkpoint has another shard count): a group restart's
    LoadCheckpoint and a lost store's `restore`."""
    from services.embedding_ps import checkpoint

    return checkpoint.load_shard(directory, stores, shard=shard, num_shards=num_shards,
                                 shard_of=lambda ids: shard_of(ids, num_shards))


REPLICA_WAIT_S = 15.0
"""How long a shard that lost its store waits for the PS keeping its backup to answer (that PS may be
restarting too) before it restores the checkpoint instead."""


def restore(config: Config, shard: int, stores: dict[int, EmbeddingStore], applied: AppliedLog, *,
            lost: int) -> lives.Loss:
    """Fill the shard's new, empty stores before it serves: from its backup when `ps.replicas` is 2 and the
    backup follows the lost life `lost` (services/embedding_ps/replica.py), else from its part of the newest
    complete checkpoint. The returned Loss says what the copy held of the lost life, so the run can count
    what that life applied and the copy lacks."""
    if config.ps.replicas > 1:
        held = restore_from_backup(config, shard, stores, applied, lost=lost, wait_s=REPLICA_WAIT_S)
        if held is not None:
            log.get().warning("ps_shard_restored_from_backup", shard=shard, lost_life=lost, applied_by_lost_life=held,
                              rows=sum(s.num_rows for s in stores.values()),
                              backup_ps=backup_host(shard, len(config.cluster.ps)),
                              why="the job has trained this shard and its store is gone; its backup held every "
                                  "update it had shipped")
            return lives.Loss(life=lost, applied_at_checkpoint=held, restored_step=-1, from_replica=True)
    refused: list[ValueError] = []
    for newest in checkpoints.complete(config.checkpoint.dir):
        try:
            loaded = load_part(newest, stores, shard=shard, num_shards=len(config.cluster.ps))
            break
        except ValueError as exc:  # refused before a row was loaded: an older checkpoint may be whole
            refused.append(exc)
            log.get().error("ps_checkpoint_refused", shard=shard, checkpoint=str(newest), error=str(exc),
                            then="the next older complete checkpoint")
    else:
        if refused:  # checkpoints there are, none readable: an operator must look, not an empty table served
            raise ValueError(f"shard {shard} lost its store and every checkpoint was refused; the newest: "
                             f"{refused[0]}")
        log.get().error("ps_shard_started_empty", shard=shard, lost_life=lost,
                        why="the job has trained this shard, its store is gone and there is no checkpoint it can "
                            "read: every update it had applied is lost")
        return lives.Loss(life=lost, applied_at_checkpoint=0, restored_step=-1)
    applied = loaded["applied_by_life"].get(lost, 0)
    log.get().warning("ps_shard_restored", shard=shard, checkpoint=str(newest), step=loaded["step"],
                      rows=loaded["rows"], lost_life=lost, applied_at_checkpoint=applied,
                      why="the job has trained this shard and its store is gone: updates applied after the "
                          "checkpoint are lost (counted in the run's lost_updates)")
    return lives.Loss(life=lost, applied_at_checkpoint=applied, restored_step=loaded["step"])


def _observed(task: asyncio.Task) -> None:
    """Retrieve and log an update task's error: when its request was cancelled, nothing else would."""
    if not task.cancelled() and task.exception() is not None:
        log.get().warning("update_failed", error=str(task.exception()))


def _tier_stats(stores: dict[int, dict]) -> pb.TierStats | None:
    """Both tiers of the shard's stores, summed over widths (None without a disk tier)."""
    tiers = [(st, st["tier"]) for st in stores.values() if st["tier"] is not None]
    if not tiers:
        return None
    return pb.TierStats(memory_rows=sum(st["rows"] for st, _ in tiers),
                        memory_bytes=sum(st["shm_bytes"] for st, _ in tiers),
                        disk_rows=sum(t["rows"] for _, t in tiers), disk_bytes=sum(t["bytes"] for _, t in tiers),
                        lookups=sum(t["lookups"] for _, t in tiers), misses=sum(t["misses"] for _, t in tiers),
                        fills=sum(t["fills"] for _, t in tiers), writebacks=sum(t["writebacks"] for _, t in tiers),
                        overflows=sum(t["overflows"] for _, t in tiers),
                        disk_updates=sum(t["disk_updates"] for _, t in tiers))


def _tables(stores: dict[int, dict]) -> dict[int, dict[str, int]]:
    """The lifecycle counters per table (feature group), summed over the stores of every width."""
    tables: dict[int, dict[str, int]] = {}
    for st in stores.values():
        for group, counters in st["tables"].items():
            into = tables.setdefault(int(group), {})
            for name, count in counters.items():
                into[name] = into.get(name, 0) + int(count)
    return tables


class EmbeddingPSServicer:
    def __init__(self, stores: dict[int, EmbeddingStore], applied: AppliedLog, shard: int, num_shards: int,
                 values: ValueCodec, executor: ThreadPoolExecutor, *, checkpoint_root: str | None = None,
                 publish_root: str | None = None, losses: list[lives.Loss] | None = None, full_every: int = 1,
                 primary: Primary | None = None, backup: Backup | None = None, max_ids: int | None = None,
                 ps_identities: list[str] | None = None):
        self.stores, self.shard, self.num_shards = stores, shard, num_shards
        self.ps_identities = ps_identities
        """cluster.ps_identities: which PS may make each PS-peer call (None: any, by the role's rule)."""
        self.max_ids = max_ids
        """The most IDs a Lookup or Update may name (`frames.max_ids` of the job; None: not bounded): a request
        of 10^8 IDs would allocate gigabytes, and a training one admit them all and evict the table."""
        self.primary, self.backup = primary, backup
        """ps.replicas: 2: this shard's shipments to its backup, and the backup this PS keeps of another."""
        self.losses = losses or []
        """Lives of this shard that lost their store during the job (lives.py), oldest first."""
        self._life = ((shard, applied.life),)  # which life acknowledges an update (frames.Applied.lives)
        self.applied = applied
        """Update ids this shard applied: a re-sent update is acknowledged without applying it again."""
        self._updating: dict[int, asyncio.Task] = {}  # update id -> the task applying it
        self.values, self.executor = values, executor
        self.checkpoint_root = checkpoint_root
        """checkpoint.dir: the only place Checkpoint and LoadCheckpoint may write or read (None: refused)."""
        self.full_every = full_every
        """checkpoint.full_every: the longest chain of dumps (a full one and its deltas)."""
        self.counters = {"lookups_total": 0, "updates_total": 0, "rows_looked_up_total": 0, "rows_updated_total": 0,
                         "versions_written_total": 0, "version_rows_written_total": 0, "checkpoints_total": 0,
                         "checkpoint_deltas_total": 0, "checkpoint_bytes_total": 0}
        # Live versions (publish.dir set): which IDs changed since this shard last published, and which
        # version that was (None: never, or the last publish failed; a delta then needs a full first).
        self.publish_root = publish_root
        """publish.dir: where Publish writes, `v{version}/` under it (None: Publish is refused)."""
        self.changes = ChangeLog(sorted(stores)) if publish_root else None
        self.published: int | None = None
        self._publishing = asyncio.Lock()

    def stats(self, stores: dict[int, dict] | None = None) -> dict[str, float]:
        """Request counters and, per width, the store's occupancy (read at every metrics scrape). `stores`:
        each store's `stats()` when the caller has them already."""
        stores = self._store_stats() if stores is None else stores
        values: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        values["updates_deduplicated_total"] = float(self.applied.deduplicated)  # every process of this life
        values["stores_lost_total"] = float(len(self.losses))
        values["restored_step"] = float(self.losses[-1].restored_step if self.losses else -1)
        for dim, st in stores.items():
            values.update({f"dim{dim}_rows": st["rows"], f"dim{dim}_capacity": st["capacity"],
                           f"dim{dim}_evictions_total": st["evictions"],
                           f"dim{dim}_admission_drops_total": st["admission_drops"],
                           f"dim{dim}_missing_updates_total": st["missing_updates"],
                           f"dim{dim}_shm_bytes": st["shm_bytes"], f"dim{dim}_sketch_bytes": st["sketch_bytes"],
                           f"dim{dim}_row_bytes": st["row_bytes"]})
            if st["tier"] is not None:  # the disk tier (ps.tier)
                t = st["tier"]
                values.update({f"dim{dim}_disk_rows": t["rows"], f"dim{dim}_disk_bytes": t["bytes"],
                               f"dim{dim}_disk_fills_total": t["fills"],
                               f"dim{dim}_disk_writebacks_total": t["writebacks"],
                               f"dim{dim}_disk_overflows_total": t["overflows"],
                               f"dim{dim}_disk_updates_total": t["disk_updates"],
                               f"dim{dim}_disk_reads_total": t["disk_reads"],
                               f"dim{dim}_tier_lookups_total": t["lookups"],
                               f"dim{dim}_tier_misses_total": t["misses"]})
        for group, counters in _tables(stores).items():  # the lifecycle's counters per table (feature group)
            values.update({f"table{group}_{name}_total": float(count) for name, count in counters.items()})
        if self.primary is not None:
            values.update({k: float(v) for k, v in self.primary.counters.items()})
        if self.backup is not None:
            values.update(self.backup.stats())
        return values

    def _store_stats(self) -> dict[int, dict]:
        return {dim: store.stats() for dim, store in self.stores.items()}

    async def sweep_expired(self, interval_s: float) -> None:
        """Remove expired rows (`ps.lifecycle` TTLs) every `interval_s` until cancelled; on the event loop,
        each store's sweep on the request threads (one stripe locked at a time)."""
        stores = [store for store in self.stores.values() if store.config.uses_ttl]
        while stores:
            await asyncio.sleep(interval_s)
            for store in stores:
                removed = await self._run(store.expire)
                if removed:
                    log.get().debug("rows_expired", dim=store.config.dim, rows=removed)

    def _check_shard(self, ids: np.ndarray) -> np.ndarray:
        if ids.size and not np.all(shard_of(ids, self.num_shards) == self.shard):
            raise ValueError(f"request holds IDs of another shard; this is shard {self.shard} of {self.num_shards}")
        return ids

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def Lookup(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        lookup = PSLookup.decode(request, self.stores, self.max_ids)
        out: dict[int, np.ndarray] = {}
        for dim, ids in lookup.ids.items():
            out[dim] = await self._run(self.stores[dim].lookup, self._check_shard(ids), train=lookup.train)
            self.counters["rows_looked_up_total"] += out[dim].shape[0]
            if lookup.train and self.changes is not None:  # may have admitted new rows
                self.changes.add(dim, ids)
        self.counters["lookups_total"] += 1
        at_work("lookup served")
        return PSRows(out).encode(self.values)

    async def Update(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Apply an update once: a re-send of an applied update id is acknowledged with 0 rows and counted."""
        update = PSUpdate.decode(request, self.values, self.stores, self.max_ids)
        for ids in update.ids.values():  # every width checked before any row changes
            self._check_shard(ids)
        if not any(ids.size for ids in update.ids.values()):
            # Changes nothing, and is not recorded: a stream of empty updates under fresh ids would roll the
            # window of applied ids (`applied.py`) past a real update, whose re-send would then apply twice.
            # (An embedding worker sends a shard no update without rows of its own.)
            return Applied(0, self._life).encode()
        uid = update.update_id
        while (running := self._updating.get(uid)) is not None:  # a re-send racing its original
            with contextlib.suppress(Exception):
                await asyncio.shield(running)
        if uid in self.applied:
            self.applied.count_duplicate()
            return Applied(0, self._life).encode()
        task = asyncio.ensure_future(self._apply_replicated(update) if self.primary else self._apply(update))
        self._updating[uid] = task
        task.add_done_callback(_observed)
        return Applied(await asyncio.shield(task), self._life).encode()

    async def _apply(self, update: PSUpdate) -> int:
        """Apply an update's rows, then record its id. A task of its own, shielded from the request: when the
        sender dies mid-call (gRPC cancels the handler) the rows still change in a thread, and the record
        must follow them, or the sender's re-send would apply them twice."""
        try:
            applied = 0
            for dim, ids in update.ids.items():
                applied += await self._run(self.stores[dim].update, ids, update.grads[dim])
                if self.changes is not None:  # logged after the update is applied: never before its rows change
                    self.changes.add(dim, ids)
            self.applied.record(update.update_id)  # after the rows: a crash between re-applies, never drops
            for store in self.stores.values():  # the clock of step TTLs: one tick per update request
                store.tick()
            self.counters["updates_total"] += 1
            self.counters["rows_updated_total"] += applied
            return applied
        finally:
            del self._updating[update.update_id]

    async def _apply_replicated(self, update: PSUpdate) -> int:
        """`_apply`, then ship the changed rows to the backup, one update at a time: the backup has them (or is
        unreachable, and counted) before the update is acknowledged."""
        async with self.primary.lock:
            applied = await self._apply(update)
            await self.primary.ship(update.update_id, update.ids, self._run)
        return applied

    async def Replicate(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Rows the primary of the shard this PS backs up changed (ps.replicas: 2): taken only from that primary
        (`cluster.ps_identities`), whatever the frame claims of its job, life and sequence."""
        if self.backup is None:
            raise FailedPrecondition(f"PS {self.shard} keeps no backup: ps.replicas is 1 in its config")
        rpc.require_caller(context, self._ps_identity(self.backup.shard), f"Replicate of shard {self.backup.shard}")
        await self.backup.replicate(ShardRows.decode(request, row_widths(self.backup.stores)), self._run)
        return Applied(0).encode()

    async def PullShard(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A page of a copy of this shard (for its backup) or of the backup this PS keeps (for the shard that
        lost its store)."""
        pull = ShardPull.decode(request)
        # A copy of the shard goes to its backup; a copy of the backup kept here, to the shard it backs up.
        caller = backup_host(self.shard, self.num_shards) if pull.copy == "primary" else pull.shard
        rpc.require_caller(context, self._ps_identity(caller), f"PullShard of the {pull.copy} of shard {pull.shard}")
        if pull.copy == "primary":
            if pull.shard != self.shard:
                raise ValueError(f"this is shard {self.shard}, not shard {pull.shard}")
            if self.primary is None:
                raise FailedPrecondition(f"shard {self.shard} has no backup: ps.replicas is 1 in its config")
            return (await self.primary.page(pull, self._run)).encode()
        if self.backup is None:
            raise FailedPrecondition(f"PS {self.shard} keeps no backup: ps.replicas is 1 in its config")
        return (await self.backup.page(pull, self._run)).encode()

    def _ps_identity(self, index: int) -> str | None:
        """The certificate identity of PS `index` (`cluster.ps_identities`; None: not configured)."""
        identities = self.ps_identities
        return identities[index] if identities is not None and 0 <= index < len(identities) else None

    async def Stats(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.ServiceStats:
        stores = self._store_stats()  # once for both parts
        return pb.ServiceStats(service="embedding_ps", replica=self.shard, values=self.stats(stores),
                               recovery=self.recovery(stores))

    def recovery(self, stores: dict[int, dict] | None = None) -> pb.RecoveryStats:
        """What a run's summary reads of this shard, typed: rows per width, re-sent updates answered without
        applying them again, and the lifecycle counters of every table."""
        stores = self._store_stats() if stores is None else stores
        return pb.RecoveryStats(updates_deduplicated=int(self.applied.deduplicated),
                                rows_by_width={dim: int(st["rows"]) for dim, st in stores.items()},
                                tables=[pb.TableLifecycle(group=g, **c) for g, c in sorted(_tables(stores).items())],
                                life=self.applied.life,
                                losses=[pb.ShardLoss(shard=self.shard, **loss.model_dump()) for loss in self.losses],
                                tier=_tier_stats(stores))

    async def Checkpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointReply:
        from services.embedding_ps import checkpoint

        directory = resolve_under(self.checkpoint_root, request.name)
        manifest = await self._run(checkpoint.dump_shard, self.stores, directory, shard=self.shard,
                                   num_shards=self.num_shards, step=request.step, life=self.applied.life,
                                   applied=self.applied.applied,
                                   base=request.base if request.HasField("base") else None,
                                   full_every=self.full_every)
        rows = sum(int(s.stats()["rows"]) for s in self.stores.values())
        self.counters["checkpoints_total"] += 1
        self.counters["checkpoint_deltas_total"] += int(manifest["delta"])
        self.counters["checkpoint_bytes_total"] += checkpoint.dump_bytes(manifest)
        return pb.CheckpointReply(name=request.name, rows=rows, chain=manifest["chain"],
                                  bytes=checkpoint.dump_bytes(manifest))

    async def LoadCheckpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointReply:
        directory = resolve_under(self.checkpoint_root, request.name)
        if self.primary is None:
            await self._run(load_part, directory, self.stores, shard=self.shard, num_shards=self.num_shards)
        else:  # between two updates, and the backup told to copy the shard again
            async with self.primary.lock:
                await self._run(load_part, directory, self.stores, shard=self.shard, num_shards=self.num_shards)
                await self.primary.start_over(self._run)
        rows = sum(int(s.stats()["rows"]) for s in self.stores.values())
        return pb.CheckpointReply(name=request.name, rows=rows)


    async def Publish(self, request: pb.PublishRequest, context) -> pb.PublishReply:
        """Write this shard's rows of model version `request.version` (docs/serving.md#live-versions)."""
        if self.changes is None:
            raise ValueError("publishing is off on this PS: publish.dir is not set in its config")
        path = version_dir(self.publish_root, request.version)  # ValueError for a version out of range
        async with self._publishing:
            if not request.full and (self.published is None or self.published != request.base_version):
                raise FailedPrecondition(f"shard {self.shard} cannot write a delta on version "
                                         f"{request.base_version}: it last published "
                                         f"{'nothing' if self.published is None else self.published}")
            changed = self.changes.take()
            self.published = None  # until this one is written
            files, rows = await self._run(publish_shard, self.stores, path, shard=self.shard,
                                          num_shards=self.num_shards, changed=None if request.full else changed)
            self.published = request.version
        self.counters["versions_written_total"] += 1
        self.counters["version_rows_written_total"] += sum(rows.values())
        return pb.PublishReply(rows=sum(rows.values()), rows_by_dim=rows, files=[
            pb.PublishedFile(path=rel, bytes=e.bytes, sha256=e.sha256) for rel, e in files.items()])


async def serve(config: Config, replica: int) -> None:
    host = ServiceHost("embedding_ps", config, replica)
    checkpoints.check_root(config.checkpoint.dir)
    torch_import = None
    if config.training.compression.fp16:  # only the fp16 value codec uses torch here; one thread beats contention
        torch_import = import_torch_in_background(threads=1)
    started = time.monotonic()
    warm_up(config, updates_first=replica % 2 == 1)
    host.log.info("warmed_up", seconds=round(time.monotonic() - started, 3))
    stores, applied, losses = open_shard(config, replica)
    host.log.info("stores_open", shm_dir=str(shard_dir(config, replica)),
                  rows={dim: int(s.stats()["rows"]) for dim, s in stores.items()},
                  updates_deduplicated=applied.deduplicated, life=applied.life, lives_lost=len(losses))
    values = ValueCodec(fp16=config.training.compression.fp16, kappa=config.training.compression.kappa)
    num_shards = len(config.cluster.ps)
    primary = backup = None
    if config.ps.replicas > 1:  # services/embedding_ps/replica.py
        primary = Primary(replica, num_shards, config.cluster.ps[backup_host(replica, num_shards)], stores, applied,
                          config.checkpoint.job_id or "")
        backup = Backup(config, backup_of(replica, num_shards), config.cluster.ps[backup_of(replica, num_shards)])
    with ThreadPoolExecutor(max_workers=config.ps.threads, thread_name_prefix="ps-store") as executor:
        servicer = EmbeddingPSServicer(stores, applied, replica, num_shards, values, executor,
                                       checkpoint_root=config.checkpoint.dir,
                                       publish_root=config.publish.dir if config.publish.enabled else None,
                                       losses=losses, primary=primary, backup=backup,
                                       full_every=config.checkpoint.full_every, max_ids=max_ids(config),
                                       ps_identities=config.cluster.ps_identities)
        host.add(servicer, servicer.stats)
        await host.start()
        await imported(torch_import)
        await host.set_serving(True)
        if backup is not None:
            backup.catch_up()
        sweeper = asyncio.ensure_future(servicer.sweep_expired(config.ps.lifecycle.sweep_interval_s))
        try:
            await host.run_until_stopped()
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            for part in (primary, backup):
                if part is not None:
                    await part.close()
            for store in stores.values():
                store.close()
            applied.close()
