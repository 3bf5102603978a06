"""Replicated PS shards (`ps.replicas: 2`): a backup of every shard on another PS, so that losing a PS host
loses no acknowledged update.

Placement: with N shards, PS process i serves shard i (its primary) and keeps the backup of shard i-1 (the
last shard's on PS 0), in its own stores under `<ps.shm_dir>/backup-NNNNN/`. On Kubernetes the PS pods
repel each other across nodes (deploy/k8s), so the two copies of a shard never share a host; on one
machine (`hybridrec run`) they share it, which covers a lost process and a lost store, not a lost machine.

Consistency: synchronous primary-backup. The primary applies an update and then ships the rows it changed,
whole (values and optimizer state), to the backup, and acknowledges the update once the backup has
answered. Shipping rows rather than gradients keeps the backup free of decisions of its own: it runs no
optimizer, admits and evicts nothing by itself, and cannot drift from the primary by replaying them
differently. One shard's updates are applied and shipped one at a time (`Primary.lock`), so the backup
sees them in the primary's order, numbered by `seq` (the primary life's count of applied updates). Lookups
go to the primary only. What replicating costs is measured by `benchmarks/replicas.py`.

Catching up: a backup that was restarted, or that sees a gap in `seq` (a shipment that failed), or a new
life of its primary, copies the whole shard again from the primary, page by page (PullShard). Shipments
keep arriving meanwhile and are applied at once; a row shipped after the copy was taken is newer than the
copy's, so the copy's pages skip it. Until the copy is complete and no shipment is missing, the backup is
not in sync and will not stand in for its primary.

Failing over: a shard whose store is gone (services/embedding_ps/lives.py) asks its backup for a copy of
the life it lost before it serves, and inherits the update ids that copy remembers, so a re-sent update is
still applied once. Only a backup in sync with that life will do; otherwise the shard restores the newest
checkpoint as without replicas. The loss it records says what the backup held of the lost life
(`applied_at_checkpoint`, `from_replica`), so the run's `lost_updates` stays exact.

Degraded: while its backup is unreachable the primary acknowledges updates without it (counted in
`replica_shipments_failed_total`, logged once per outage): training goes on, and that shard is unreplicated
until the backup has caught up. What is not replicated: the admission sketch (`ps.lifecycle.admit_after`
counts start over on the backup) and rows a training lookup admitted that no update has reached yet (a
restored shard initialises them again from (seed, id), to the same values).
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import numpy as np

from hybridrec.core.runtime import log, rpc
from hybridrec.core.config import Config
from hybridrec.core.wire.frames import ShardPull, ShardRows
from hybridrec.core.runtime.rpc import FailedPrecondition
from services.embedding_ps.applied import AppliedLog
from services.embedding_ps.store import EmbeddingStore, StoreConfig

PAGE_ROWS = 1 << 16
"""Rows per PullShard page (a few megabytes)."""
SHIP_TIMEOUT_S = 5.0
"""How long the primary waits for its backup's answer before it acknowledges without it."""
RECONNECT_MS = 500
"""The primary's channel to its backup retries a lost connection this often (gRPC's default backoff grows to
two minutes, which would keep a restarted backup out of sync that long)."""

Run = Callable[..., Awaitable]
"""The servicer's `_run`: a store call on its request threads."""


def backup_of(ps: int, num_shards: int) -> int:
    """The shard whose backup PS process `ps` keeps."""
    return (ps - 1) % num_shards


def backup_host(shard: int, num_shards: int) -> int:
    """The PS process that keeps shard `shard`'s backup."""
    return (shard + 1) % num_shards


def backup_dir(config: Config, shard: int) -> Path:
    return Path(config.ps.shm_dir) / f"backup-{shard:05d}"


def open_stores_in(directory: Path, config: Config) -> dict[int, EmbeddingStore]:
    """One store per width under `directory` (a shard's own directory, or a backup's); none left open when one
    cannot be opened."""
    stores: dict[int, EmbeddingStore] = {}
    try:
        for dim in config.dims:
            stores[dim] = EmbeddingStore.open(directory / f"dim-{dim}", StoreConfig.from_config(config, dim))
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    return stores


def check_job(theirs: str, ours: str, what: str) -> None:
    """Refuse a peer of another job (two jobs' PS on reused addresses): FailedPrecondition naming both."""
    if theirs != ours:
        raise FailedPrecondition(f"{what} comes from job {theirs!r}; this PS serves job {ours!r} "
                                 f"(checkpoint.job_id): no rows of another job are taken or given")


def row_widths(stores: dict[int, EmbeddingStore]) -> dict[int, int]:
    return {dim: store.config.row_width for dim, store in stores.items()}


@dataclass
class Copy:
    """A whole copy of a shard's rows at one moment, held while a peer reads it page by page."""

    shard: int
    life: int
    seq: int
    pages: list[tuple[int, np.ndarray, np.ndarray]]  # (width, keys, values)
    uids: np.ndarray
    id: int = 0
    """Its name for the readers of its later pages (`OpenCopies`)."""

    @classmethod
    def take(cls, shard: int, life: int, seq: int, stores: dict[int, EmbeddingStore], uids: np.ndarray) -> "Copy":
        """On a request thread, with the shard's updates held back (`Primary.lock`) or stopped."""
        pages = []
        for dim, store in stores.items():
            keys, values, _ = store.snapshot()
            pages += [(dim, keys[lo:lo + PAGE_ROWS], values[lo:lo + PAGE_ROWS])
                      for lo in range(0, max(keys.shape[0], 1), PAGE_ROWS)]
        return cls(shard, life, seq, pages, uids)

    def page(self, i: int) -> ShardRows:
        if not 0 <= i < len(self.pages):
            raise FailedPrecondition(f"shard {self.shard}'s copy has {len(self.pages)} pages, not {i + 1}")
        dim, keys, values = self.pages[i]
        last = i == len(self.pages) - 1
        return ShardRows(self.shard, self.life, self.seq, {dim: (keys, values)}, page=i, pages=len(self.pages),
                         uids=self.uids if last else None, copy_id=self.id)


class OpenCopies:
    """The copies of one shard that peers are reading, by id. Two readers at once (a backup catching up and an
    operator's dump of the same shard, or a reader that started over) each read their own copy to its end;
    with one copy per shard, the second's page 0 replaced the first's copy under it. At most `KEEP` are held
    (each is a whole shard in memory): a newer one drops the oldest, whose reader is told to start over."""

    KEEP = 2

    def __init__(self, what: str):
        self.what = what
        self._open: OrderedDict[int, Copy] = OrderedDict()

    def open(self, copy: Copy) -> None:
        copy.id = secrets.randbits(63) | 1  # random: a reader of a PS that restarted never finds its id again
        self._open[copy.id] = copy
        while len(self._open) > self.KEEP:
            self._open.popitem(last=False)

    def page(self, pull: ShardPull, copy_id: int) -> ShardRows:
        """Page `pull.page` of copy `copy_id` (page 0: the one just opened); the copy goes once read to its end."""
        copy = self._open.get(copy_id)
        if copy is None:
            raise FailedPrecondition(f"no copy {copy_id} of {self.what} is being read (read to its end, replaced "
                                     f"by newer ones, or this PS restarted): ask for page 0 first")
        out = copy.page(pull.page)
        if pull.page == len(copy.pages) - 1:
            del self._open[copy_id]  # read to its end: its memory goes
        return out


Received = list[tuple[int, int, dict[int, np.ndarray]]]
"""Shipments a backup applied while it was catching up: (life, seq, keys per width)."""


def rows_to_keep(keys: np.ndarray, dim: int, received: Received, *, life: int, seq: int) -> np.ndarray:
    """Which rows of a copy's page (of width `dim`, taken at `seq` of `life`) a catching-up backup loads: not
    those a later shipment of that life brought already, whose rows are newer than the copy's."""
    newer = [k[dim] for r_life, r_seq, k in received if r_life == life and r_seq > seq and dim in k]
    return ~np.isin(keys, np.concatenate(newer)) if newer else np.ones(keys.shape[0], bool)


def seq_after(received: Received, *, life: int, seq: int) -> int | None:
    """Where a backup stands once it loaded a copy taken at `seq` of `life` plus the shipments it received
    meanwhile: the last shipment's seq, or None when one is missing (it copies again)."""
    seqs = sorted({r_seq for r_life, r_seq, _ in received if r_life == life and r_seq > seq})  # a heartbeat repeats one
    if seqs != list(range(seq + 1, seq + 1 + len(seqs))):
        return None
    return seqs[-1] if seqs else seq


class Primary:
    """The primary side of a shard: ships every applied update to the backup, and serves copies of itself."""

    def __init__(self, shard: int, num_shards: int, backup_address: str, stores: dict[int, EmbeddingStore],
                 applied: AppliedLog, job: str):
        self.shard, self.stores, self.applied, self.job = shard, stores, applied, job
        self.backup = backup_host(shard, num_shards)
        self.lock = asyncio.Lock()
        """Held while an update is applied and shipped, and while a copy is taken: one order for both copies."""
        self._channel = rpc.channel(backup_address, reconnect_ms=RECONNECT_MS)
        self._ship = rpc.raw_method(self._channel, "EmbeddingPS", "Replicate")
        self._copies = OpenCopies(f"shard {shard}")
        self._reachable = True
        self._heartbeat: asyncio.Task | None = None
        self.counters = {"replica_shipments_total": 0, "replica_shipments_failed_total": 0,
                         "replica_copies_served_total": 0}

    async def ship(self, update_id: int, ids: dict[int, np.ndarray], run: Run) -> None:
        """Send the rows update `update_id` changed (under `lock`, after the rows and the record): the backup
        has applied them when this returns, or it is unreachable and the update goes unreplicated."""
        rows = {}
        for dim, keys in ids.items():
            values, found = await run(self.stores[dim].peek, keys, state=True)
            rows[dim] = (keys[found], values[found])  # a gradient for an absent row changed nothing
        frame = ShardRows(self.shard, self.applied.life, self.applied.applied, rows, update_id=update_id, job=self.job)
        try:
            await self._ship(frame.encode(), timeout=SHIP_TIMEOUT_S if self._reachable else SHIP_TIMEOUT_S / 10)
        except grpc.aio.AioRpcError as exc:
            self.counters["replica_shipments_failed_total"] += 1
            if self._reachable:
                log.get().warning("replica_unreachable", shard=self.shard, backup_ps=self.backup,
                                  code=exc.code().name, detail=exc.details(),
                                  why="updates are acknowledged without a backup until it has caught up")
                self._reachable = False
            if self._heartbeat is None or self._heartbeat.done():
                self._heartbeat = asyncio.ensure_future(self._tell_where_it_is())
            return
        self.counters["replica_shipments_total"] += 1
        if not self._reachable:
            log.get().info("replica_reachable", shard=self.shard, backup_ps=self.backup)
            self._reachable = True

    async def _tell_where_it_is(self) -> None:
        """After a shipment failed, send the backup where this shard is (an empty frame at its current seq) until
        one gets through: a backup that missed shipments and hears of no later update would otherwise stay "in
        sync" behind its primary (it sees the gap only at the next shipment)."""
        delay = 0.1
        while True:
            await asyncio.sleep(delay)
            async with self.lock:  # every update up to it has been shipped (or failed to be)
                frame = ShardRows(self.shard, self.applied.life, self.applied.applied, {}, job=self.job)
            try:  # not under the lock: updates go on meanwhile, and the backup ignores a heartbeat it passed
                await self._ship(frame.encode(), timeout=SHIP_TIMEOUT_S / 10)
                return
            except grpc.aio.AioRpcError:
                delay = min(delay * 2, 1.0)

    async def start_over(self, run: Run) -> None:
        """Tell the backup to copy the shard again (its rows were replaced: a checkpoint loaded); under `lock`."""
        try:
            await self._ship(ShardRows(self.shard, self.applied.life, 0, {}, job=self.job).encode(),
                             timeout=SHIP_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:  # it copies the shard whole when it is back anyway
            log.get().warning("replica_not_told_to_start_over", shard=self.shard, code=exc.code().name)

    async def page(self, pull: ShardPull, run: Run) -> ShardRows:
        """A page of a copy of this shard: page 0 takes the copy (between two updates), later pages read it."""
        check_job(pull.job, self.job, f"a request for a copy of shard {self.shard}")
        if pull.page == 0:
            if not self._reachable:  # the backup asks for a copy: it is back, so shipments get their full wait
                log.get().info("replica_reachable", shard=self.shard, backup_ps=self.backup, why="it asked for a copy")
                self._reachable = True
            async with self.lock:
                copy = await run(Copy.take, self.shard, self.applied.life, self.applied.applied, self.stores,
                                 self.applied.recent())
            self._copies.open(copy)
            self.counters["replica_copies_served_total"] += 1
            return self._copies.page(pull, copy.id)
        return self._copies.page(pull, pull.copy_id)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self._channel.close()


class Backup:
    """The backup this PS keeps of another shard: applies what its primary ships, catches up by copying the
    primary whole, and stands in for it when the primary loses its store."""

    def __init__(self, config: Config, shard: int, primary_address: str):
        self.config, self.shard, self.directory = config, shard, backup_dir(config, shard)
        self.job = config.checkpoint.job_id or ""
        self.stores: dict[int, EmbeddingStore] = {}
        self.applied: AppliedLog | None = None
        self.life = 0
        """The primary life this copy follows (0: none yet)."""
        self.seq = 0
        """That life's count of applied updates this copy holds."""
        self.in_sync = False
        self._received: Received = []  # shipments applied while catching up
        self._catching_up: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one change at a time: a shipment, a page of a copy, a wipe
        self._channel = rpc.channel(primary_address, reconnect_ms=RECONNECT_MS)
        self._pull = rpc.raw_method(self._channel, "EmbeddingPS", "PullShard")
        self._serving = OpenCopies(f"shard {shard}'s backup")
        self.counters = {"backup_catch_ups_total": 0}
        self._wipe()

    def _wipe(self) -> None:
        """Start the copy over: a backup never trusts rows it held before it caught up (its process may have
        missed shipments while it was down)."""
        self._close_stores()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.stores = open_stores_in(self.directory, self.config)
        self.applied = AppliedLog.open(self.directory / "applied")
        self.in_sync, self.life, self.seq = False, 0, 0
        self._received.clear()

    def _close_stores(self) -> None:
        for store in self.stores.values():
            store.close()
        if self.applied is not None:
            self.applied.close()
        self.stores, self.applied = {}, None

    def catch_up(self) -> None:
        """Copy the primary whole, in the background (at start, and after a gap)."""
        if self._catching_up is None:
            self._catching_up = asyncio.ensure_future(self._catch_up())

    async def replicate(self, rows: ShardRows, run: Run) -> None:
        """Apply a shipment of the primary. In order (the next `seq` of the life this copy follows) it keeps
        the copy in sync; out of order the copy starts over."""
        if rows.shard != self.shard:
            raise ValueError(f"this PS keeps the backup of shard {self.shard}, not of shard {rows.shard}")
        check_job(rows.job, self.job, f"a shipment of shard {rows.shard}")
        async with self._lock:
            if rows.seq == 0:  # the primary's rows were replaced (a checkpoint loaded): copy it again from scratch
                if self._catching_up is not None:
                    self._catching_up.cancel()
                    self._catching_up = None
                log.get().info("backup_starting_over", shard=self.shard, life=rows.life)
                self._wipe()
                self.catch_up()
                return
            if not rows.rows and not rows.update_id:  # where the primary is (after a shipment failed)
                if self._catching_up is not None:
                    self._received.append((rows.life, rows.seq, {}))  # the copy must reach it
                elif not self.in_sync or rows.life != self.life or rows.seq > self.seq:  # it missed some
                    log.get().warning("backup_out_of_sync", shard=self.shard, life=rows.life, seq=rows.seq,
                                      held_life=self.life, held_seq=self.seq, in_sync=self.in_sync)
                    self._wipe()
                    self.catch_up()
                return
            in_order = self.in_sync and rows.life == self.life and rows.seq == self.seq + 1
            if not in_order and self._catching_up is None:
                log.get().warning("backup_out_of_sync", shard=self.shard, life=rows.life, seq=rows.seq,
                                  held_life=self.life, held_seq=self.seq, in_sync=self.in_sync)
                self._wipe()
                self.catch_up()
            for dim, (keys, values) in rows.rows.items():
                await run(self.stores[dim].load_rows, keys, np.require(values, requirements=["C", "W"]))
            if rows.update_id and rows.update_id not in self.applied:
                self.applied.record(rows.update_id)
            if self._catching_up is not None:
                self._received.append((rows.life, rows.seq, {dim: keys for dim, (keys, _) in rows.rows.items()}))
            else:
                self.seq = rows.seq

    async def _catch_up(self) -> None:
        try:
            delay = 0.05
            while True:
                try:
                    if await self._copy_primary():
                        return
                    reason = "the primary's copy changed or a shipment is missing"
                except (grpc.aio.AioRpcError, ValueError) as exc:
                    reason = str(exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc)
                log.get().info("backup_catching_up_again", shard=self.shard, reason=reason[:300])
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                async with self._lock:
                    self._wipe()
        finally:
            if self._catching_up is asyncio.current_task():  # not a newer one that replaced this cancelled one
                self._catching_up = None

    async def _copy_primary(self) -> bool:
        """One attempt at copying the primary; True once this copy is in sync."""
        started, loop = time.monotonic(), asyncio.get_running_loop()
        widths = row_widths(self.stores)
        first = ShardRows.decode(await self._pull(ShardPull(self.shard, "primary", job=self.job).encode(),
                                                  timeout=60), widths)
        page = first
        for i in range(first.pages):
            if i:
                pull = ShardPull(self.shard, "primary", i, job=self.job, copy_id=first.copy_id)
                page = ShardRows.decode(await self._pull(pull.encode(), timeout=60), widths)
                if (page.life, page.seq) != (first.life, first.seq):
                    return False
            async with self._lock:
                for dim, (keys, values) in page.rows.items():
                    keep = rows_to_keep(keys, dim, self._received, life=first.life, seq=first.seq)
                    await loop.run_in_executor(None, self.stores[dim].load_rows, keys[keep],
                                               np.require(values[keep], requirements=["C", "W"]))
                if page.uids is not None:
                    self.applied.inherit(page.uids)
        async with self._lock:
            seq = seq_after(self._received, life=first.life, seq=first.seq)
            if seq is None:
                return False
            self.life, self.seq = first.life, seq
            self.in_sync, self._catching_up = True, None
            self._received.clear()
        self.counters["backup_catch_ups_total"] += 1
        log.get().info("backup_in_sync", shard=self.shard, life=self.life, seq=self.seq, copied_at_seq=first.seq,
                       shipped_meanwhile=seq - first.seq, pages=first.pages,
                       rows=sum(s.num_rows for s in self.stores.values()), seconds=round(time.monotonic() - started, 3))
        return True

    async def page(self, pull: ShardPull, run: Run) -> ShardRows:
        """A page of this backup's copy, for its primary that lost its store (which names the life it lost)."""
        if pull.shard != self.shard:
            raise ValueError(f"this PS keeps the backup of shard {self.shard}, not of shard {pull.shard}")
        check_job(pull.job, self.job, f"a request for the backup of shard {self.shard}")
        if pull.page == 0:
            if not self.in_sync or self._catching_up is not None:
                raise FailedPrecondition(f"the backup of shard {self.shard} is not in sync with its primary")
            if pull.life and pull.life != self.life:
                raise FailedPrecondition(f"the backup of shard {self.shard} follows life {self.life}, not the "
                                         f"lost life {pull.life}")
            async with self._lock:
                copy = await run(Copy.take, self.shard, self.life, self.seq, self.stores, self.applied.recent())
            self._serving.open(copy)
            return self._serving.page(pull, copy.id)
        return self._serving.page(pull, pull.copy_id)

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counters.items()}, "backup_in_sync": float(self.in_sync),
                "backup_seq": float(self.seq),
                "backup_rows": float(sum(s.num_rows for s in self.stores.values()))}

    async def close(self) -> None:
        if self._catching_up is not None:
            self._catching_up.cancel()
        await self._channel.close()
        self._close_stores()


def restore_from_backup(config: Config, shard: int, stores: dict[int, EmbeddingStore], applied: AppliedLog, *,
                        lost: int, wait_s: float) -> int | None:
    """Copy shard `shard`'s backup, which must follow the lost life `lost`, into its new, empty stores, and
    inherit the update ids it remembers (before the shard serves; blocking). Returns what the backup held of
    the lost life (its count of applied updates), or None when no backup can stand in (not in sync, another
    life, unreachable for `wait_s`): the caller restores the checkpoint instead."""
    address = config.cluster.ps[backup_host(shard, len(config.cluster.ps))]
    widths, job = row_widths(stores), config.checkpoint.job_id or ""
    deadline = time.monotonic() + wait_s
    with rpc.sync_channel(address) as channel:
        call = channel.unary_unary("/hybridrec.EmbeddingPS/PullShard")
        while True:
            try:
                first = ShardRows.decode(call(ShardPull(shard, "backup", 0, lost, job).encode(), timeout=60), widths)
                break
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                log.get().warning("ps_backup_cannot_stand_in", shard=shard, backup=address, code=exc.code().name,
                                  detail=exc.details())
                return None
        page = first
        for i in range(first.pages):
            if i:
                pull = ShardPull(shard, "backup", i, lost, job, first.copy_id)
                page = ShardRows.decode(call(pull.encode(), timeout=60), widths)
            for dim, (keys, values) in page.rows.items():
                stores[dim].load_rows(keys, np.require(values, requirements=["C", "W"]))
            if page.uids is not None:
                applied.inherit(page.uids)
    return first.seq
