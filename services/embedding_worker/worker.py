"""On the embedding worker: buffer a batch's IDs, look them up on the PS shards, pool, aggregate gradients.

The data loader hands a batch's ID features in (`put`) and gets a batch_ref;
an NN worker later asks for the pooled embeddings of that batch_ref (`lookup`)
and eventually returns the gradients of those pooled embeddings (`push_gradients`).
All per-batch planning (global dedup per embedding width, the split by PS shard)
happens in `put`, so the lookup on the NN worker's critical path only does the
RPCs and the pooling. One RPC per PS shard per batch carries every width.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from hybridrec import codec
from hybridrec.batch import SparseBatch
from hybridrec.compress import ValueCodec
from hybridrec.config import Config
from hybridrec.rpc import NotFound
from hybridrec.sharding import split_by_shard
from services.embedding_worker.pooling import MODE_CODES, pool, unpool

REF_SHIFT = 56

PSCall = Callable[[int, str, bytes], Awaitable[bytes]]  # (shard, method, frame) -> reply frame


@dataclass
class FeatureSlot:
    """Where one feature's bags live: its width group, its columns in the pooled output, its row indices."""

    dim: int
    column: int
    idx: np.ndarray  # int32 index into the width group's unique IDs, one per bag element
    lengths: np.ndarray  # uint16 bag length per sample
    mode: int


@dataclass
class BufferedBatch:
    ref: int
    phase: str
    batch_size: int
    uniq: dict[int, np.ndarray]  # width -> unique IDs of every feature of that width
    by_shard: dict[int, list[np.ndarray]]  # width -> per shard, positions into uniq[width]
    slots: list[FeatureSlot]
    created: float = field(default_factory=time.monotonic)


class EmbeddingWorker:
    """The embedding worker's state and logic, independent of gRPC."""

    def __init__(self, config: Config, replica: int, ps_call: PSCall):
        self.features = config.features
        self.num_shards = len(config.cluster.ps)
        self.replica = replica
        self.ps_call = ps_call
        self.values = ValueCodec(fp16=config.training.compression.fp16, kappa=config.training.compression.kappa)
        self.vector_dim = math.gcd(*[f.dim for f in self.features])
        self.total_dim = sum(f.dim for f in self.features)
        self.buffer: dict[int, BufferedBatch] = {}
        self.next_seq = 0
        self.counters = {"batches_put": 0, "lookups": 0, "gradient_pushes": 0, "rows_looked_up": 0,
                         "rows_updated": 0, "batches_dropped": 0}

    # -- from the data loader -------------------------------------------------------------
    def put(self, sparse: SparseBatch) -> int:
        """Buffer a batch and return its batch_ref (this worker's replica in the top bits)."""
        ref = (self.replica << REF_SHIFT) | self.next_seq
        self.next_seq += 1
        uniq: dict[int, np.ndarray] = {}
        slots: list[FeatureSlot] = []
        column = 0
        for dim in sorted({f.dim for f in self.features}):
            members = [i for i, f in enumerate(self.features) if f.dim == dim]
            all_ids = np.concatenate([sparse.uniq[i] for i in members])
            uniq[dim], inverse = np.unique(all_ids, return_inverse=True)
            inverse = inverse.astype(np.int32).reshape(-1)
            start = 0
            for i in members:
                n = sparse.uniq[i].shape[0]
                idx = inverse[start:start + n][sparse.pos[i]] if n else np.zeros(0, np.int32)
                start += n
                slots.append((i, FeatureSlot(dim, 0, idx, sparse.lengths[i], MODE_CODES[self.features[i].pooling])))
        # Pooled output columns follow the configured feature order.
        ordered = [slot for _, slot in sorted(slots, key=lambda t: t[0])]
        for slot in ordered:
            slot.column = column
            column += slot.dim
        by_shard = {dim: split_by_shard(ids, self.num_shards) for dim, ids in uniq.items()}
        self.buffer[ref] = BufferedBatch(ref, sparse.phase, sparse.batch_size, uniq, by_shard, ordered)
        self.counters["batches_put"] += 1
        return ref

    # -- from an NN worker ----------------------------------------------------------------
    async def lookup(self, ref: int) -> bytes:
        """Pooled embeddings of a buffered batch, (batch, total width), as a frame."""
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
        out = np.empty((batch.batch_size, self.total_dim), np.float32)
        for slot in batch.slots:
            pool(rows[slot.dim], slot.idx, slot.lengths, slot.mode, out[:, slot.column:slot.column + slot.dim])
        if not train:
            del self.buffer[ref]
        self.counters["lookups"] += 1
        self.counters["rows_looked_up"] += sum(ids.shape[0] for ids in batch.uniq.values())
        return codec.encode(self.values.pack("emb", out, self.vector_dim), {"batch_ref": ref})

    async def push_gradients(self, ref: int, frame: codec.Frame) -> int:
        """Aggregate pooled gradients per unique ID and apply them on the PS shards; returns rows updated."""
        batch = self._get(ref)
        if batch.phase != "train":
            raise ValueError(f"batch_ref {ref} is an eval batch; it takes no gradients")
        grads = self.values.unpack(frame.tensors, "grad", self.vector_dim) if "grad" in frame.tensors else None
        if grads is None or grads.shape != (batch.batch_size, self.total_dim):
            raise ValueError(f"gradients must be ({batch.batch_size}, {self.total_dim}) float for batch_ref {ref}")
        del self.buffer[ref]  # the batch is consumed whatever the PS answers
        per_dim = {dim: np.zeros((ids.shape[0], dim), np.float32) for dim, ids in batch.uniq.items()}
        for slot in batch.slots:
            unpool(grads[:, slot.column:slot.column + slot.dim], slot.idx, slot.lengths, slot.mode,
                   per_dim[slot.dim])

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
        self.counters["gradient_pushes"] += 1
        self.counters["rows_updated"] += applied
        return applied

    def _get(self, ref: int) -> BufferedBatch:
        batch = self.buffer.get(ref)
        if batch is None:
            raise NotFound(f"batch_ref {ref} is not buffered on embedding worker {self.replica}")
        return batch

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counters.items()}, "buffered_batches": float(len(self.buffer))}
