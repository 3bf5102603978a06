"""On the embedding worker: buffer a batch's IDs, look them up on the PS shards, aggregate gradients.

The data loader hands a batch's ID features in (`put`) and gets a batch_ref;
an NN worker later asks for that batch's embeddings (`lookup`) and eventually
returns their gradients (`push_gradients`).

What crosses the network is deduplicated both ways (Persia paper (Lian et al., KDD 2022) §4.2.3): the NN
worker receives each feature's *unique* rows plus the uint16 positions and bag
lengths it needs to pool them, and sends back one gradient per unique row — not
one vector per sample. All per-batch planning (the batch-unique IDs of each
embedding width, the split by PS shard) happens in `put`, off the NN worker's
critical path; a lookup is then one RPC per PS shard and a gather. The IDs
arrive deduplicated per feature; features of one width are merged again only
where their IDs repeat (a shared table).

The buffer outlives the process: every batch is also on file until it is
consumed (`buffer_files.py`), so a worker restarted after kill -9 serves
the batches its previous life held, under the same batch_refs; and every
update it sends carries the batch's update id, which each PS shard applies
at most once, so a push re-sent across a restart is never applied twice.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

from hybridrec.core.runtime import log
from hybridrec.core.wire.proto import pb
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import Config, ids_per_sample
from hybridrec.core.wire.dedup import has_duplicates, unique_inverse
from hybridrec.core.wire.frames import (INCARNATION_SHIFT, Applied, Embeddings, Gradients, PSLookup, PSRows, PSUpdate,
                              SparseBatch, make_batch_ref, update_id)
from hybridrec.core.runtime.rpc import NotFound, Unavailable
from hybridrec.core.wire.sharding import split_by_shard
from services.embedding_worker.aggregation import scatter_add_rows
from services.embedding_worker.buffer_files import BufferFiles


PSCall = Callable[[int, str, bytes], Awaitable[bytes]]  # (shard, method, frame) -> reply frame
SEQ_MASK = (1 << INCARNATION_SHIFT) - 1


def buffer_dir(config: Config, replica: int) -> Path:
    """Where embedding worker `replica` keeps its buffered batches: next to the PS shards' stores, so
    `hybridrec run`'s private shm directory (and its removal at the end) covers both."""
    return Path(config.ps.shm_dir) / f"embedding-worker-{replica:05d}"


@dataclass
class BufferedBatch:
    ref: int
    phase: str
    sparse: SparseBatch
    uniq: dict[int, np.ndarray]  # width -> batch-unique IDs of every feature of that width
    # width -> int32 index into uniq[width] of each feature-unique row, features concatenated; None where
    # the features' unique IDs, concatenated, are already unique (uniq[width] is that concatenation)
    gidx: dict[int, np.ndarray | None]
    by_shard: dict[int, list[np.ndarray]]  # width -> per shard, positions into uniq[width]
    looked_up: bool = False  # a train batch whose embeddings an NN worker has had: its update is owed
    nbytes: int = 0  # its frame's size, as buffered on file


class EmbeddingWorker:
    """The embedding worker's state and logic, independent of gRPC.

    Every buffered batch is also on file (`BufferFiles`, under `buffer_dir`):
    a worker started on the directory of a dead one re-plans the batches it
    left and serves them under their original batch_refs. Call `close` to
    release the directory.
    """

    def __init__(self, config: Config, replica: int, ps_call: PSCall):
        self.features = config.features
        self.ids_per_sample = ids_per_sample(self.features)  # what bounds a batch's frame (`SparseBatch.decode`)
        self.num_shards = len(config.cluster.ps)
        self.replica = replica
        self.ps_call = ps_call
        self.log = log.get(__name__)
        self.values = ValueCodec(fp16=config.training.compression.fp16, kappa=config.training.compression.kappa)
        self.dims = sorted({f.dim for f in self.features})
        # Features of each width, in config order: the order of their rows in an Embeddings frame.
        self.members = {dim: [i for i, f in enumerate(self.features) if f.dim == dim] for dim in self.dims}
        self.buffer: dict[int, BufferedBatch] = {}
        # The incarnation (in every batch_ref) and the next sequence number live in the buffer's header:
        # a restarted worker keeps handing out new refs of the same incarnation and serves the old ones;
        # a worker on a new directory draws a new incarnation, so a ref of a lost buffer gets NOT_FOUND,
        # never some other batch's embeddings.
        self.files = BufferFiles.open(buffer_dir(config, replica), features=self.features, replica=replica)
        self.incarnation = self.files.incarnation
        self.counters = {"batches_put_total": 0, "lookups_total": 0, "gradient_pushes_total": 0,
                         "updates_discarded_total": 0, "rows_looked_up_total": 0, "rows_updated_total": 0,
                         "pushes_already_applied_total": 0, "lookups_repeated_total": 0, "puts_held_back_total": 0}
        self.buffer_cap = config.ps.worker_buffer_bytes
        self.buffered_bytes = 0
        """The bytes of every batch in the buffer (their frames, as on file): at most `buffer_cap`."""
        self.acks: Counter[tuple[int, int]] = Counter()
        """Updates each PS shard's life acknowledged in this worker's successful pushes, (shard, life) -> count:
        what a run's summary counts as lost when a life loses its store (services/embedding_ps/lives.py)."""
        self._recover()

    def _recover(self) -> None:
        """Re-plan every batch a previous life of this worker left buffered, under its original batch_ref."""
        recovered = 0
        for stored in self.files.stored():
            try:
                sparse = SparseBatch.decode(stored.frame, len(self.features), self.ids_per_sample)
            except ValueError as exc:  # written whole by put, so only a foreign hand gets here
                self.log.error("buffered_batch_unreadable", seq=stored.seq, error=str(exc))
                self.files.drop(stored.seq)
                continue
            ref = make_batch_ref(self.replica, self.incarnation, stored.seq)
            self.buffer[ref] = self._plan(ref, sparse, len(stored.frame))
            self.buffered_bytes += len(stored.frame)
            recovered += 1
        if recovered:
            self.files.count_recovered(recovered)
            self.log.info("buffer_recovered", batches=recovered, directory=str(self.files.directory))

    def close(self) -> None:
        self.files.close()

    # -- from the data loader -------------------------------------------------------------
    def put(self, frame: bytes) -> int:
        """Buffer a batch (a `SparseBatch` frame, as the data loader sent it) and return its batch_ref (this
        worker's replica in the top bits). The batch is on file, as these very bytes, before the ref is
        handed out."""
        sparse = SparseBatch.decode(frame, len(self.features), self.ids_per_sample)
        if self.buffered_bytes + len(frame) > self.buffer_cap and self.buffer:
            # Back-pressure, not a failure: the data loader retries (UNAVAILABLE, up to cluster.retry_s) while
            # the NN workers consume what is buffered. A batch alone in the buffer always fits.
            self.counters["puts_held_back_total"] += 1
            raise Unavailable(f"embedding worker {self.replica}'s buffer holds {self.buffered_bytes:,} bytes of "
                              f"batches; another {len(frame):,} would pass ps.worker_buffer_bytes "
                              f"({self.buffer_cap:,}): try again once the NN workers have consumed some")
        seq = self.files.reserve()
        ref = make_batch_ref(self.replica, self.incarnation, seq)
        batch = self._plan(ref, sparse, len(frame))
        try:
            self.files.write(seq, frame)
        except OSError as exc:  # e.g. a full /dev/shm: the data loader tries the next embedding worker
            raise Unavailable(f"embedding worker {self.replica} cannot buffer a batch in "
                              f"{self.files.directory}: {exc}") from exc
        self.buffer[ref] = batch
        self.buffered_bytes += len(frame)
        self.counters["batches_put_total"] += 1
        return ref

    def _plan(self, ref: int, sparse: SparseBatch, nbytes: int = 0) -> BufferedBatch:
        """The batch-unique IDs per width and their split by PS shard: all a lookup and a push need.

        The data loader deduplicated each feature, and features of distinct groups cannot share an ID (the
        group is in its top bits), so a width's per-feature uniques, concatenated, are usually unique
        already: one hashed pass (no allocation) finds that out and the width needs no index. Only where IDs repeat
        (features that share a table, or a frame whose "unique" IDs repeat) are they merged."""
        uniq: dict[int, np.ndarray] = {}
        gidx: dict[int, np.ndarray | None] = {}
        for dim, members in self.members.items():
            parts = [sparse.uniq[i] for i in members]
            ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if has_duplicates(ids):
                uniq[dim], gidx[dim] = unique_inverse(ids)
            else:
                uniq[dim], gidx[dim] = ids, None
        by_shard = {dim: split_by_shard(ids, self.num_shards) for dim, ids in uniq.items()}
        return BufferedBatch(ref, sparse.phase, sparse, uniq, gidx, by_shard, nbytes=nbytes)

    # -- from an NN worker ----------------------------------------------------------------
    async def lookup(self, ref: int) -> bytes:
        """An `Embeddings` frame: each feature's unique rows (per width, features concatenated), positions
        and bag lengths. An eval batch is consumed by its lookup; asked again (this worker died before
        its answer got out), it is served from its kept frame."""
        batch = self.buffer.get(ref) or self._served_eval_batch(ref)
        train = batch.phase == "train"
        rows = {dim: np.empty((ids.shape[0], dim), np.float32) for dim, ids in batch.uniq.items()}

        async def one_shard(shard: int) -> None:
            request = PSLookup({dim: batch.uniq[dim][pos[shard]] for dim, pos in batch.by_shard.items()}, train)
            if not any(ids.size for ids in request.ids.values()):
                return
            expected = {dim: ids.shape[0] for dim, ids in request.ids.items()}
            reply = PSRows.decode(await self.ps_call(shard, "Lookup", request.encode()), self.values, expected)
            for dim, pos in batch.by_shard.items():
                rows[dim][pos[shard]] = reply.rows[dim]

        await asyncio.gather(*(one_shard(s) for s in range(self.num_shards)))
        sparse = batch.sparse
        frame = Embeddings(
            bags=sparse.bags,
            counts=np.array([u.shape[0] for u in sparse.uniq], np.int32),
            rows={dim: rows[dim] if batch.gidx[dim] is None else rows[dim][batch.gidx[dim]] for dim in self.dims},
        ).encode(self.values, lz4=False)  # raw: see CompressionConfig.lz4_ids
        if train:
            batch.looked_up = True
        else:
            self._consumed(batch)
        self.counters["lookups_total"] += 1
        self.counters["rows_looked_up_total"] += sum(ids.shape[0] for ids in batch.uniq.values())
        return frame

    def _served_eval_batch(self, ref: int) -> BufferedBatch:
        """An eval batch this worker already looked up, planned again from its kept frame; NotFound if none."""
        seq = self._own_seq(ref)
        frame = self.files.served_frame(seq) if seq is not None else None
        if frame is None:
            raise self._not_found(ref)
        self.counters["lookups_repeated_total"] += 1
        return self._plan(ref, SparseBatch.decode(frame, len(self.features), self.ids_per_sample))

    def rows_of(self, ref: int) -> dict[int, int]:
        """Rows per width of the `Embeddings` frame of a buffered train batch: what its gradients must hold."""
        batch = self._get(ref)
        if batch.phase != "train":
            raise ValueError(f"batch_ref {ref} is an eval batch; it takes no gradients")
        return {dim: (batch.uniq[dim] if batch.gidx[dim] is None else batch.gidx[dim]).shape[0] for dim in self.dims}

    def already_applied(self, ref: int) -> bool:
        """Whether `ref` is a train batch of this worker whose update every PS shard has acknowledged: a push
        of it again (this worker died before its answer got out) is answered without applying anything."""
        seq = self._own_seq(ref)
        if seq is None or ref in self.buffer or not self.files.was_applied(seq):
            return False
        self.counters["pushes_already_applied_total"] += 1
        return True

    async def push_gradients(self, gradients: Gradients) -> Applied:
        """Sum gradients per batch-unique ID and apply them on the PS shards; returns the rows updated and the
        life of each shard that acknowledged (counted in `acks` once the push succeeds).

        `gradients` was decoded against `rows_of`, so its shapes match the batch.
        The batch stays buffered until every shard has acknowledged its part:
        a push that fails, or a worker that dies midway, leaves it to be pushed
        again, and each shard applies the batch's update id at most once."""
        ref = gradients.batch_ref
        batch = self._get(ref)
        if batch.phase != "train":
            raise ValueError(f"batch_ref {ref} is an eval batch; it takes no gradients")
        per_dim: dict[int, np.ndarray] = {}
        for dim in self.dims:
            if batch.gidx[dim] is None:  # one gradient per batch-unique ID already
                per_dim[dim] = gradients.grads[dim]
                continue
            per_dim[dim] = np.zeros((batch.uniq[dim].shape[0], dim), np.float32)
            scatter_add_rows(gradients.grads[dim], batch.gidx[dim], per_dim[dim])
        uid = update_id(ref, self.files.nonce)

        async def one_shard(shard: int) -> Applied:
            ids = {dim: batch.uniq[dim][pos[shard]] for dim, pos in batch.by_shard.items() if pos[shard].size}
            if not ids:
                return Applied(0)
            update = PSUpdate(ids, {dim: per_dim[dim][batch.by_shard[dim][shard]] for dim in ids}, uid)
            return Applied.decode(await self.ps_call(shard, "Update", update.encode(self.values)))

        # Every shard's call ends before this does: a push that fails has left nothing running behind it.
        results = await asyncio.gather(*(one_shard(s) for s in range(self.num_shards)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        applied = Applied(sum(r.applied for r in results), tuple(pair for r in results for pair in r.lives))
        self.acks.update(applied.lives)
        self._consumed(batch)
        self.counters["gradient_pushes_total"] += 1
        self.counters["rows_updated_total"] += applied.applied
        return applied

    def discard(self, ref: int) -> Applied:
        """Let training batch `ref` go without an update: its step's loss or gradients were not finite, so the
        NN workers applied nothing of it, and neither may a PS shard."""
        batch = self._get(ref)
        if batch.phase != "train":
            raise ValueError(f"batch_ref {ref} is an eval batch; it takes no gradients")
        self._consumed(batch)
        self.counters["updates_discarded_total"] += 1
        return Applied(0)

    def _consumed(self, batch: BufferedBatch) -> None:
        if self.buffer.pop(batch.ref, None) is not None:
            self.buffered_bytes -= batch.nbytes
        self.files.consumed(batch.ref & SEQ_MASK, eval_batch=batch.phase != "train")

    def _own_seq(self, ref: int) -> int | None:
        """The sequence number of `ref` if this worker's incarnation made it, else None."""
        seq = ref & SEQ_MASK
        return seq if make_batch_ref(self.replica, self.incarnation, seq) == ref else None

    def _get(self, ref: int) -> BufferedBatch:
        batch = self.buffer.get(ref)
        if batch is None:
            raise self._not_found(ref)
        return batch

    def _not_found(self, ref: int) -> NotFound:
        return NotFound(f"batch_ref {ref} is not buffered on embedding worker {self.replica} "
                        f"(incarnation {self.incarnation}, buffer {self.files.directory})")

    def stats(self) -> dict[str, float]:
        """Counters, and what the buffer holds now (the metrics' names; a run's summary reads `recovery`)."""
        recovery = self.recovery()
        return {**{k: float(v) for k, v in self.counters.items()}, "buffered_batches": float(len(self.buffer)),
                "buffered_bytes": float(self.buffered_bytes),
                "unapplied_train_batches": float(recovery.unapplied_train_batches),
                "batches_recovered_total": float(recovery.batches_recovered)}

    def recovery(self) -> pb.RecoveryStats:
        """What a run's summary reads of this worker, typed: the batches a previous life left buffered, and the
        train batches trained on (looked up) whose update is not yet applied — at the end of a run, exactly the
        updates that were lost."""
        return pb.RecoveryStats(batches_recovered=int(self.files.recovered),
                                unapplied_train_batches=sum(1 for b in self.buffer.values() if b.looked_up),
                                acks=[pb.ShardAcks(shard=shard, life=life, updates=n)
                                      for (shard, life), n in sorted(self.acks.items())])
