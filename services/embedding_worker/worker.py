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

from hybridrec import codec
from hybridrec.batch import SparseBatch, make_batch_ref
from hybridrec.compress import ValueCodec
from hybridrec.config import Config
from hybridrec.rpc import NotFound
from hybridrec.sharding import split_by_shard
from services.embedding_worker.pooling import scatter_add_rows


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
        # Features of each width, in config order: the order of their rows in `rows.<dim>` frames.
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
        """Each feature's unique rows (per width, features concatenated), positions and bag lengths."""
        batch = self._get(ref)
        train = batch.phase == "train"
        rows = {dim: np.empty((ids.shape[0], dim), np.float32) for dim, ids in batch.uniq.items()}

        async def one_shard(shard: int) -> None:
            tensors = {f"ids.{dim}": batch.uniq[dim][pos[shard]] for dim, pos in batch.by_shard.items()}
            if not any(t.size for t in tensors.values()):
                return
            reply = codec.decode(await self.ps_call(shard, "Lookup", codec.encode(tensors, {"train": train})))
            for dim, pos in batch.by_shard.items():
                got = self.values.unpack(reply.tensors, f"rows.{dim}", dim)
                if got.shape != (pos[shard].shape[0], dim):
                    raise RuntimeError(f"PS shard {shard} returned {got.shape} rows for {pos[shard].shape[0]} IDs")
                rows[dim][pos[shard]] = got

        await asyncio.gather(*(one_shard(s) for s in range(self.num_shards)))
        sparse = batch.sparse
        tensors: dict[str, np.ndarray] = {
            "counts": np.array([u.shape[0] for u in sparse.uniq], np.int32),
            "pos": np.concatenate(sparse.pos) if sparse.pos else np.zeros(0, np.uint16),
            "lengths": np.stack(sparse.lengths),
        }
        for dim in self.dims:
            tensors.update(self.values.pack(f"rows.{dim}", rows[dim][batch.gidx[dim]], dim))
        if not train:
            del self.buffer[ref]
        self.counters["lookups_total"] += 1
        self.counters["rows_looked_up_total"] += sum(ids.shape[0] for ids in batch.uniq.values())
        compress = {"pos", "lengths"} if self.lz4 else set()
        return codec.encode(tensors, {"batch_ref": ref, "batch_size": sparse.batch_size}, compress=compress)

    async def push_gradients(self, ref: int, frame: codec.Frame) -> int:
        """Sum gradients per batch-unique ID and apply them on the PS shards; returns rows updated."""
        batch = self._get(ref)
        if batch.phase != "train":
            raise ValueError(f"batch_ref {ref} is an eval batch; it takes no gradients")
        per_dim: dict[int, np.ndarray] = {}
        for dim in self.dims:
            name = f"grad.{dim}"
            grads = self.values.unpack(frame.tensors, name, dim) if name in frame.tensors else None
            if grads is None or grads.shape != (batch.gidx[dim].shape[0], dim):
                raise ValueError(f"{name} must hold ({batch.gidx[dim].shape[0]}, {dim}) gradients for "
                                 f"batch_ref {ref}")
            per_dim[dim] = np.zeros((batch.uniq[dim].shape[0], dim), np.float32)
            scatter_add_rows(grads, batch.gidx[dim], per_dim[dim])
        del self.buffer[ref]  # the batch is consumed whatever the PS answers

        async def one_shard(shard: int) -> int:
            tensors: dict[str, np.ndarray] = {}
            for dim, pos in batch.by_shard.items():
                if pos[shard].size:
                    tensors[f"ids.{dim}"] = batch.uniq[dim][pos[shard]]
                    tensors.update(self.values.pack(f"grads.{dim}", per_dim[dim][pos[shard]], dim))
            if not tensors:
                return 0
            reply = codec.decode(await self.ps_call(shard, "Update", codec.encode(tensors)))
            return reply.meta_int("applied", default=0)

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
