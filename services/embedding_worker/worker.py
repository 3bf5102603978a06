"""On the embedding worker: buffer a batch's IDs, look them up on the PS shards, aggregate gradients.

The data loader hands a batch's ID features in (`put`) and gets a batch_ref;
an NN worker later asks for that batch's embeddings (`lookup`) and eventually
returns their gradients (`push_gradients`).

What crosses the network is deduplicated both ways (Persia paper (Lian et al., KDD 2022) §4.2.3): the NN
worker receives each feature's *unique* rows plus the uint16 positions and bag
lengths it needs to pool them, and sends back one gradient per unique row — not
one vector per sample. All per-batch planning (dedup per embedding width across
features, the split by PS shard) happens in `put`, off the NN worker's critical
path; a lookup is then one RPC per PS shard and a gather.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from hybridrec.compress import ValueCodec
from hybridrec.config import Config
from hybridrec.frames import (Applied, Embeddings, Gradients, PSLookup, PSRows, PSUpdate, SparseBatch,
                             make_batch_ref)
from hybridrec.rpc import NotFound
from hybridrec.sharding import split_by_shard
from services.embedding_worker.aggregation import scatter_add_rows


PSCall = Callable[[int, str, bytes], Awaitable[bytes]]  # (shard, method, frame) -> reply frame


@dataclass
class BufferedBatch:
    ref: int
    phase: str
    sparse: SparseBatch
    uniq: dict[int, np.ndarray]  # width -> batch-unique IDs of every feature of that width
    gidx: dict[int, np.ndarray]  # width -> int32 index into uniq[width] of each feature-unique row, features concatenated
    by_shard: dict[int, list[np.ndarray]]  # width -> per shard, positions into uniq[width]


class EmbeddingWorker:
    """The embedding worker's state and logic, independent of gRPC."""

    def __init__(self, config: Config, replica: int, ps_call: PSCall):
        self.features = config.features
        self.num_shards = len(config.cluster.ps)
        self.replica = replica
        self.ps_call = ps_call
        self.values = ValueCodec(fp16=config.training.compression.fp16, kappa=config.training.compression.kappa)
        self.lz4 = config.training.compression.lz4_ids
        self.dims = sorted({f.dim for f in self.features})
        # Features of each width, in config order: the order of their rows in an Embeddings frame.
        self.members = {dim: [i for i, f in enumerate(self.features) if f.dim == dim] for dim in self.dims}
        self.buffer: dict[int, BufferedBatch] = {}
        # A restarted worker must never hand out a batch_ref its previous life gave out: an NN worker
        # still holding an old ref gets NOT_FOUND, not some other batch's embeddings.
        self.incarnation = secrets.randbelow(1 << 16)
        self.next_seq = 0
        self.counters = {"batches_put_total": 0, "lookups_total": 0, "gradient_pushes_total": 0,
                         "rows_looked_up_total": 0, "rows_updated_total": 0}

    # -- from the data loader -------------------------------------------------------------
    def put(self, sparse: SparseBatch) -> int:
        """Buffer a batch and return its batch_ref (this worker's replica in the top bits)."""
        if len(sparse.uniq) != len(self.features):
            raise ValueError(f"batch has {len(sparse.uniq)} features, the config has {len(self.features)}")
        ref = make_batch_ref(self.replica, self.incarnation, self.next_seq)
        self.next_seq += 1
        uniq, gidx = {}, {}
        for dim, members in self.members.items():
            uniq[dim], inverse = np.unique(np.concatenate([sparse.uniq[i] for i in members]), return_inverse=True)
            gidx[dim] = inverse.astype(np.int32).reshape(-1)
        by_shard = {dim: split_by_shard(ids, self.num_shards) for dim, ids in uniq.items()}
        self.buffer[ref] = BufferedBatch(ref, sparse.phase, sparse, uniq, gidx, by_shard)
        self.counters["batches_put_total"] += 1
        return ref

    # -- from an NN worker ----------------------------------------------------------------
    async def lookup(self, ref: int) -> bytes:
        """An `Embeddings` frame: each feature's unique rows (per width, features concatenated), positions
        and bag lengths."""
        batch = self._get(ref)
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
            batch_size=sparse.batch_size,
            counts=np.array([u.shape[0] for u in sparse.uniq], np.int32),
            pos=np.concatenate(sparse.pos) if sparse.pos else np.zeros(0, np.uint16),
            lengths=np.stack(sparse.lengths),
            rows={dim: rows[dim][batch.gidx[dim]] for dim in self.dims},
        ).encode(self.values, lz4=self.lz4)
        if not train:
            del self.buffer[ref]
        self.counters["lookups_total"] += 1
        self.counters["rows_looked_up_total"] += sum(ids.shape[0] for ids in batch.uniq.values())
        return frame

    def rows_of(self, ref: int) -> dict[int, int]:
        """Rows per width of the `Embeddings` frame of a buffered train batch: what its gradients must hold."""
        batch = self._get(ref)
        if batch.phase != "train":
            raise ValueError(f"batch_ref {ref} is an eval batch; it takes no gradients")
        return {dim: batch.gidx[dim].shape[0] for dim in self.dims}

    async def push_gradients(self, gradients: Gradients) -> int:
        """Sum gradients per batch-unique ID and apply them on the PS shards; returns rows updated.

        `gradients` was decoded against `rows_of`, so its shapes match the batch."""
        ref = gradients.batch_ref
        batch = self._get(ref)
        if batch.phase != "train":
            raise ValueError(f"batch_ref {ref} is an eval batch; it takes no gradients")
        per_dim: dict[int, np.ndarray] = {}
        for dim in self.dims:
            per_dim[dim] = np.zeros((batch.uniq[dim].shape[0], dim), np.float32)
            scatter_add_rows(gradients.grads[dim], batch.gidx[dim], per_dim[dim])
        del self.buffer[ref]  # the batch is consumed whatever the PS answers

        async def one_shard(shard: int) -> int:
            ids = {dim: batch.uniq[dim][pos[shard]] for dim, pos in batch.by_shard.items() if pos[shard].size}
            if not ids:
                return 0
            update = PSUpdate(ids, {dim: per_dim[dim][batch.by_shard[dim][shard]] for dim in ids})
            return Applied.decode(await self.ps_call(shard, "Update", update.encode(self.values))).applied

        applied = sum(await asyncio.gather(*(one_shard(s) for s in range(self.num_shards))))
        self.counters["gradient_pushes_total"] += 1
        self.counters["rows_updated_total"] += applied
        return applied

    def _get(self, ref: int) -> BufferedBatch:
        batch = self.buffer.get(ref)
        if batch is None:
            raise NotFound(f"batch_ref {ref} is not buffered on embedding worker {self.replica}")
        return batch

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counters.items()}, "buffered_batches": float(len(self.buffer))}
