"""Pooling of embedding bags for the dense model: one code path for training and serving.

The NN worker decodes a batch's embeddings (`Pooler.decode`) and pools them
differentiably; the inference service builds the same bag structure from a
request's features, a `hybridrec.jagged.KeyedBags` (`Pooler.from_bags`).
Both come to one plan (`Pooler._plan`) and are pooled by the same
`Pooler.pool`, so a served prediction is computed exactly as in training:
scalar, multi-hot and sequence features alike.

The embedding worker sends each feature's unique rows (grouped by width, the
features of a width concatenated in config order), the uint16 position of every
bag element in its feature's rows, and every bag's length. Pooling happens here,
with one `embedding_bag` call per width over all (feature, sample) bags, so the
backward pass yields exactly one gradient per unique row — what goes back.

A feature with `pooling: none` (a sequence) is not pooled: the model gets a
`SeqEmbedding`, its rows gathered into (batch, max_len, width) in the data's
order (oldest first, zeros after each sample's length) and the lengths. The
gather reads the same leaf as the bags, so its gradient goes back the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from hybridrec.compress import Fp16Rows, ValueCodec, unscale
from hybridrec.config import FeatureConfig, Pooling
from hybridrec.frames import Embeddings, FrameError
from hybridrec.jagged import KeyedBags


class SeqEmbedding(NamedTuple):
    """A sequence feature as the model gets it (`pooling: none`)."""

    values: torch.Tensor  # (batch, max_len, width): element j of sample i at [i, j], oldest first, then zeros
    lengths: torch.Tensor  # int64 (batch,): elements of each sample


@dataclass
class BatchEmbeddings:
    """One batch's embeddings as received: rows per width plus the bag structure to pool them."""

    batch_size: int
    rows: dict[int, np.ndarray]  # width -> (unique rows of its features, width) float32 (or `Fp16Rows`)
    index: dict[int, np.ndarray]  # width -> int64 row of every bag element, pooled features of that width in order
    offsets: dict[int, np.ndarray]  # width -> int64 start of every (pooled feature, sample) bag
    weights: dict[int, np.ndarray | None]  # width -> per-element weights (mean / sqrt-n pooling) or None
    sequences: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """feature index -> (int64 (batch, max_len) row of each element, -1 past the length; lengths)."""


class Pooler:
    def __init__(self, features: list[FeatureConfig], values: ValueCodec, *, keep_fp16: bool = False):
        """`keep_fp16`: `decode` leaves fp16 rows as they came (`Fp16Rows`) and `pool` scales them back on its
        device: a GPU worker copies half the bytes and does the arithmetic on the GPU."""
        self.features, self.values, self.keep_fp16 = features, values, keep_fp16
        self.dims = sorted({f.dim for f in features})
        self.members = {d: [i for i, f in enumerate(features) if f.dim == d] for d in self.dims}
        self.pooled = {d: [i for i in m if not features[i].sequence] for d, m in self.members.items()}
        self.names = [f.name for f in features]
        self.widths = [f.dim for f in features]
        self.weighted = any(f.pooling not in (Pooling.SUM, Pooling.NONE) for f in features)
        # (first, last + 1) of a width's pooled features when they are neighbours in config order, else None
        self.spans = {d: (p[0], p[-1] + 1) if p and p == list(range(p[0], p[-1] + 1)) else None
                      for d, p in self.pooled.items()}

    def decode(self, frame_bytes: bytes, batch_size: int) -> BatchEmbeddings:
        """Decode (and validate) an `Embeddings` frame into the bag structure `pool` needs."""
        frame = Embeddings.decode(frame_bytes, self.values, self.widths, batch_size, keep_fp16=self.keep_fp16)
        lengths = frame.bags.lengths.astype(np.int64)
        # A position counts within its feature's rows; the rows of a width hold its features one after another.
        base = np.zeros(len(self.features), np.int64)
        for members in self.members.values():
            counts = frame.counts[members].astype(np.int64)
            base[members] = np.cumsum(counts) - counts
        index = frame.bags.values.astype(np.int64) + np.repeat(base, np.diff(frame.bags.bounds))
        return self._plan(KeyedBags(index, lengths), frame.rows)

    def from_columns(self, ids: np.ndarray, present: np.ndarray) -> tuple[dict[int, np.ndarray], BatchEmbeddings]:
        """`from_bags` of single-valued ID columns (n, F) with a presence mask (Criteo: one ID or none per
        field): each column is a bag of at most one ID."""
        return self.from_bags(KeyedBags.from_columns(ids, present))

    def from_bags(self, keyed: KeyedBags) -> tuple[dict[int, np.ndarray], BatchEmbeddings]:
        """The bag structure of a batch's features (config order): scalar, multi-hot or sequence.

        Returns the unique IDs of each width (all features of that width
        together: what to look up) and the bag structure with `rows` left
        empty; put each width's looked-up rows, in the order of its unique IDs,
        into `rows` before `pool`. An empty bag pools to zeros and a sequence
        is padded after its length, as in training (`decode`). A sequence
        longer than its feature's `max_len` is refused: cut it first
        (`Bag.keep_last`, as the readers do).
        """
        if keyed.num_features != len(self.features):
            raise ValueError(f"{keyed.num_features} bags for {len(self.features)} features")
        uniq: dict[int, np.ndarray] = {}
        if len(self.members) == 1:  # one width: every value indexes that width's unique IDs
            dim = self.dims[0]
            uniq[dim], index = np.unique(keyed.values, return_inverse=True)
            index = index.reshape(-1).astype(np.int64, copy=False)
        else:
            bounds = keyed.bounds
            index = np.empty(keyed.values.shape[0], np.int64)
            for dim, members in self.members.items():
                at = np.concatenate([np.arange(bounds[f], bounds[f + 1]) for f in members])
                uniq[dim], inverse = np.unique(keyed.values[at], return_inverse=True)
                index[at] = inverse.reshape(-1)
        return uniq, self._plan(KeyedBags(index, keyed.lengths), {})

    def _plan(self, index: KeyedBags, rows: dict) -> BatchEmbeddings:
        """The bag structure of a batch whose every value is the row (within its width's `rows`) it reads:
        what training decodes and serving looks up come to the same plan, pooled by the same `pool`."""
        out = BatchEmbeddings(len(index), rows, {}, {}, {})
        bounds = index.bounds
        for dim, members in self.members.items():
            pooled = self.pooled[dim]
            span = self.spans[dim]
            if span is not None:  # the width's pooled features are neighbours: one slice
                out.index[dim] = index.values[bounds[span[0]]:bounds[span[1]]]
            else:
                out.index[dim] = np.concatenate([index.values[bounds[f]:bounds[f + 1]] for f in pooled]
                                                or [np.zeros(0, np.int64)])
            bag_lengths = index.lengths[pooled].reshape(-1)
            out.offsets[dim] = np.cumsum(bag_lengths) - bag_lengths
            out.weights[dim] = (np.concatenate([_bag_weights(index.lengths[f], self.features[f].pooling)
                                                for f in pooled] or [np.zeros(0, np.float32)]).astype(np.float32)
                                if self.weighted else None)
            for f in members:
                if self.features[f].sequence:
                    out.sequences[f] = _padded(index.values[bounds[f]:bounds[f + 1]], index.lengths[f],
                                               self.features[f])
        return out

    def empty(self, batch_size: int) -> BatchEmbeddings:
        """Embeddings of a batch whose every bag is empty (pooled zeros): the stand-in for a lost batch."""
        return BatchEmbeddings(
            batch_size,
            rows={d: np.zeros((0, d), np.float32) for d in self.dims},
            index={d: np.zeros(0, np.int64) for d in self.dims},
            offsets={d: np.zeros(len(m) * batch_size, np.int64) for d, m in self.pooled.items()},
            weights={d: (np.zeros(0, np.float32) if self.weighted else None) for d in self.dims},
            sequences={i: (np.full((batch_size, f.max_len), -1, np.int64), np.zeros(batch_size, np.int64))
                       for i, f in enumerate(self.features) if f.sequence},
        )

    def pool(self, emb: BatchEmbeddings, device: torch.device, *, grad: bool):
        """(leaf tensor of rows per width, pooled embedding or `SeqEmbedding` per feature name). `emb`'s arrays
        may already be tensors on `device` (the NN worker stages them there ahead: services.nn_worker.feed)."""
        leaves: dict[int, torch.Tensor] = {}
        pooled: dict[str, torch.Tensor | SeqEmbedding] = {}
        for dim, members in self.members.items():
            leaf = as_tensor(emb.rows[dim], device)
            if grad:
                leaf.requires_grad_()
            leaves[dim] = leaf
            bagged = self.pooled[dim]
            if bagged:
                weights = emb.weights[dim]
                bags = bag_sum(leaf, as_tensor(emb.index[dim], device), as_tensor(emb.offsets[dim], device),
                               None if weights is None else as_tensor(weights, device))
                for f, bag in zip(bagged, bags.view(len(bagged), emb.batch_size, dim).unbind(0)):
                    pooled[self.names[f]] = bag
            sequences = [f for f in members if f in emb.sequences]
            if sequences:  # index -1 (past a sample's length) reads the zero row appended last
                padded = torch.cat([leaf, leaf.new_zeros(1, dim)])
                for f in sequences:
                    index, lengths = (as_tensor(a, device) for a in emb.sequences[f])
                    pooled[self.names[f]] = SeqEmbedding(padded[index], lengths)
        return leaves, {name: pooled[name] for name in self.names}


def as_tensor(value: "np.ndarray | Fp16Rows | torch.Tensor", device: torch.device) -> torch.Tensor:
    """A host array (fp16 rows scaled back there) as a tensor on `device`; a tensor passes as it is."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Fp16Rows):
        return unscale(torch.from_numpy(value.half).to(device), torch.from_numpy(value.norms).to(device),
                       value.kappa)
    return torch.from_numpy(value).to(device)


class _BagSum(torch.autograd.Function):
    """`F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)` whose backward adds
    each bag's gradient into its rows in one compiled pass (`hybridrec.bag_kernels`), not autograd's
    sort-based CPU backward (about 20x slower at a Criteo batch)."""

    @staticmethod
    def forward(ctx, rows, index, offsets, weights):
        ctx.save_for_backward(index, offsets, weights)
        ctx.num_rows = rows.shape[0]
        return F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    def backward(ctx, grad_bags):
        from hybridrec.bag_kernels import bag_grad_rows  # numba: loaded by the first training step

        index, offsets, weights = ctx.saved_tensors
        out = np.zeros((ctx.num_rows, grad_bags.shape[1]), np.float32)
        bag_grad_rows(np.ascontiguousarray(grad_bags.numpy(), dtype=np.float32), index.numpy(), offsets.numpy(),
                      weights.numpy() if weights is not None else np.zeros(0, np.float32), out)
        return torch.from_numpy(out), None, None, None


def bag_sum(rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
            weights: torch.Tensor | None) -> torch.Tensor:
    """Sum pooling of the bags `offsets` delimits in `index` (rows of `rows`), optionally weighted per element.
    float32 rows on CPU that need a gradient take `_BagSum`; anything else (GPU, no gradient) autograd's
    embedding_bag."""
    if rows.requires_grad and rows.device.type == "cpu" and rows.dtype == torch.float32:
        return _BagSum.apply(rows, index, offsets, weights)
    return F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)


def _padded(rows: np.ndarray, lengths: np.ndarray, feature: FeatureConfig) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's element rows as (batch, max_len), -1 past each sample's length, and the lengths."""
    lengths = lengths.astype(np.int64)
    if lengths.size and int(lengths.max()) > feature.max_len:
        raise FrameError(f"feature {feature.name!r}: a sequence of {int(lengths.max())} elements exceeds its "
                         f"max_len {feature.max_len}")
    starts = np.cumsum(lengths) - lengths
    index = np.full((lengths.shape[0], feature.max_len), -1, np.int64)
    sample = np.repeat(np.arange(lengths.shape[0]), lengths)
    index[sample, np.arange(rows.shape[0]) - np.repeat(starts, lengths)] = rows
    return index, lengths


def _bag_weights(lengths: np.ndarray, pooling: Pooling) -> np.ndarray:
    n = lengths.astype(np.float32)
    if pooling == Pooling.SUM:
        per_bag = np.ones_like(n)
    elif pooling == Pooling.MEAN:
        per_bag = 1.0 / np.maximum(n, 1)
    else:
        per_bag = 1.0 / np.sqrt(np.maximum(n, 1))
    return np.repeat(per_bag, lengths.astype(np.int64))
