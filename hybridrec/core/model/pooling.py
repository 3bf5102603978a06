"""Pooling of embedding bags for the dense model: one code path for training and serving.

The NN worker decodes a batch's embeddings (`Pooler.decode`) and pools them
differentiably; the inference service builds the same bag structure from a
request's features, a `hybridrec.core.wire.jagged.KeyedBags` (`Pooler.from_bags`).
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

from hybridrec.core.wire import codec
from hybridrec.core.wire.compress import Fp16Rows, ValueCodec, unscale
from hybridrec.core.config import FeatureConfig, Pooling, ids_per_sample
from hybridrec.core.wire.frames import EmbeddingArrays, Embeddings, FrameError
from hybridrec.core.layouts.slot_layouts import CheckedEmbeddings
from hybridrec.core.wire.jagged import KeyedBags


class SeqEmbedding(NamedTuple):
    """A sequence feature as the model gets it (`pooling: none`)."""

    values: torch.Tensor  # (batch, max_len, width): element j of sample i at [i, j], oldest first, then zeros
    lengths: torch.Tensor  # int64 (batch,): elements of each sample


@dataclass
class BatchEmbeddings:
    """One batch's embeddings as received: rows per width plus the bag structure to pool them, kept as the
    frame carried it (no per-element index is built on the host: `pool` reads these arrays directly).

    Element e of feature f reads row `base[f] + pos[e]` of its width's `rows`; feature f's elements are
    `pos[start[f]:start[f + 1]]`, its bags one per sample in order, `lengths[f, s]` long."""

    batch_size: int
    rows: dict[int, "np.ndarray | Fp16Rows | torch.Tensor"]  # width -> (unique rows of its features, width)
    pos: "np.ndarray | torch.Tensor"  # (elements,) uint16 (a frame) or int64 (serving): row within the feature
    lengths: "np.ndarray | torch.Tensor"  # (features, batch) bag lengths
    start: np.ndarray  # int64 (features + 1,): each feature's first element in `pos` (host, always)
    base: np.ndarray  # int64 (features,): each feature's first row within its width's rows (host, always)
    sequences: dict[int, tuple] = field(default_factory=dict)
    """feature index -> (int64 (batch, max_len) row of each element, -1 past the length; lengths)."""
    device_base: "torch.Tensor | None" = None
    """`base` on the device, staged with the batch's other arrays (None: `pool` copies it there itself)."""


class PooledEmbeddings(dict):
    """What the model gets: feature name -> pooled (batch, width) tensor or `SeqEmbedding`, in config order.

    The pooled features of one width come out of one kernel as a block (batch, features, width), sample-major;
    each feature's tensor is a view of it. `side_by_side` hands a model the block itself where the names it
    asks for are the block's, so concatenating the embeddings (the usual first layer) costs no copy."""

    def __init__(self, *args):
        super().__init__(*args)
        self.blocks: list[tuple[tuple[str, ...], torch.Tensor]] = []

    def side_by_side(self, names: list[str], vector) -> torch.Tensor:
        """(batch, sum of widths) of the named features in that order; `vector(embedding)` turns an entry
        that is not a block's (a sequence, a lone feature) into its (batch, width) vector."""
        firsts = {block_names[0]: (block_names, block) for block_names, block in self.blocks}
        parts, i = [], 0
        while i < len(names):
            block_names, block = firsts.get(names[i], ((), None))
            if block is not None and tuple(names[i:i + len(block_names)]) == block_names:
                parts.append(block.reshape(block.shape[0], -1))
                i += len(block_names)
            else:
                parts.append(vector(self[names[i]]))
                i += 1
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class Pooler:
    def __init__(self, features: list[FeatureConfig], values: ValueCodec, *, keep_fp16: bool = True):
        """`keep_fp16`: `decode` leaves fp16 rows as they came (`Fp16Rows`) and `pool` scales them back on its
        device (a GPU copies half the bytes; on a CPU the compute thread does it, not the event loop)."""
        self.features, self.values, self.keep_fp16 = features, values, keep_fp16
        self.dims = sorted({f.dim for f in features})
        self.members = {d: [i for i, f in enumerate(features) if f.dim == d] for d in self.dims}
        self.pooled = {d: [i for i in m if not features[i].sequence] for d, m in self.members.items()}
        self._pooled_arrays = {d: np.array(p, np.int64) for d, p in self.pooled.items()}
        self.names = [f.name for f in features]
        self.ids_per_sample = ids_per_sample(features)
        self.widths = [f.dim for f in features]
        # a bag of n elements is divided by n to this power: 0 sum (and sequences), 1 mean, 0.5 sqrt-n
        self.powers = np.array([_POWERS.get(f.pooling, 0.0) for f in features], np.float32)
        self.weighted = bool(self.powers.any())
        # each feature's position within its width (the order of the width's rows)
        self._within = np.array([self.members[f.dim].index(i) for i, f in enumerate(features)], np.int64)
        self._sequence_features = [i for i, f in enumerate(features) if f.sequence]
        self._device_consts: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def decode(self, frame_bytes: bytes, batch_size: int) -> BatchEmbeddings:
        """Decode (and validate) an `Embeddings` frame into the bag structure `pool` needs: O(features) numpy
        calls over the frame's own arrays, no copy of them."""
        return self._structure(self._decode_frame(frame_bytes, batch_size), batch_size)

    def _decode_frame(self, frame_bytes: bytes, batch_size: int) -> codec.Frame:
        """The codec's decoding, bounded by what a batch of `batch_size` of these features can hold."""
        return Embeddings.decode_frame(frame_bytes, len(self.features), batch_size, self.ids_per_sample)

    def _structure(self, decoded: codec.Frame, batch_size: int) -> BatchEmbeddings:
        frame = Embeddings.from_frame(decoded, self.values, self.widths, batch_size, keep_fp16=self.keep_fp16,
                                      ids_per_sample=self.ids_per_sample)
        counts = frame.counts.astype(np.int64)
        base = np.zeros(len(self.features), np.int64)
        for members in self.members.values():  # a feature's rows follow those of the earlier features of its width
            base[members] = np.cumsum(counts[members]) - counts[members]
        return BatchEmbeddings(batch_size, frame.rows, frame.bags.values, frame.bags.lengths,
                               frame.bags.bounds, base, self._sequences(frame.bags.values, frame.bags.lengths,
                                                                         frame.bags.bounds, base))

    def check(self, frame_bytes: bytes, batch_size: int) -> CheckedEmbeddings:
        """`decode`, in an NN worker's receiver process: the frame checked, with what pooling derives from it,
        for its trainer, which takes views of it (`from_checked`) instead of decoding the frame itself."""
        decoded = self._decode_frame(frame_bytes, batch_size)
        emb = self._structure(decoded, batch_size)
        return CheckedEmbeddings(EmbeddingArrays.of(decoded), batch_size, emb.start, emb.base, emb.sequences)

    def from_checked(self, buf: bytes | memoryview, batch_size: int) -> BatchEmbeddings:
        """The `BatchEmbeddings` of a frame the receiver `check`ed: views of its arrays, nothing recomputed."""
        frame = CheckedEmbeddings.decode(buf, self._sequence_features)
        if frame.batch_size != batch_size:
            raise FrameError(f"embeddings of a batch of {frame.batch_size} for a batch of {batch_size}")
        rows, pos, lengths = frame.bags(self.dims, self.values.kappa)
        return BatchEmbeddings(batch_size, rows, pos, lengths, frame.start, frame.base, frame.sequences)

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
        bounds = keyed.bounds
        if len(self.members) == 1:  # one width: every value indexes that width's unique IDs
            dim = self.dims[0]
            uniq[dim], index = np.unique(keyed.values, return_inverse=True)
            index = index.reshape(-1).astype(np.int64, copy=False)
        else:
            index = np.empty(keyed.values.shape[0], np.int64)
            for dim, members in self.members.items():
                at = np.concatenate([np.arange(bounds[f], bounds[f + 1]) for f in members])
                uniq[dim], inverse = np.unique(keyed.values[at], return_inverse=True)
                index[at] = inverse.reshape(-1)
        base = np.zeros(len(self.features), np.int64)  # every position is a row of its width already
        lengths = np.ascontiguousarray(keyed.lengths, dtype=np.int64)
        return uniq, BatchEmbeddings(len(keyed), {}, index, lengths, np.asarray(bounds, np.int64), base,
                                     self._sequences(index, lengths, bounds, base))

    def _sequences(self, pos: np.ndarray, lengths: np.ndarray, bounds: np.ndarray,
                   base: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Each sequence feature's elements as (batch, max_len) rows of its width, -1 past each length."""
        return {f: _padded(pos[bounds[f]:bounds[f + 1]].astype(np.int64) + base[f], lengths[f], self.features[f])
                for f in self._sequence_features}

    def empty(self, batch_size: int) -> BatchEmbeddings:
        """Embeddings of a batch whose every bag is empty (pooled zeros): the stand-in for a lost batch."""
        features = len(self.features)
        return BatchEmbeddings(
            batch_size,
            rows={d: np.zeros((0, d), np.float32) for d in self.dims},
            pos=np.zeros(0, np.uint16), lengths=np.zeros((features, batch_size), np.uint16),
            start=np.zeros(features + 1, np.int64), base=np.zeros(features, np.int64),
            sequences={i: (np.full((batch_size, f.max_len), -1, np.int64), np.zeros(batch_size, np.int64))
                       for i, f in enumerate(self.features) if f.sequence},
        )

    def pool(self, emb: BatchEmbeddings, device: torch.device, *, grad: bool):
        """(leaf tensor of rows per width, `PooledEmbeddings`). `emb`'s arrays may already be tensors on
        `device` (the NN worker stages them there ahead: services.nn_worker.feed). On the CPU the bags are
        pooled by compiled kernels straight from the frame's arrays (`hybridrec.core.model.bag_kernels`); on other
        devices by `embedding_bag`, its index and offsets built there from the same arrays."""
        leaves: dict[int, torch.Tensor] = {}
        pooled = PooledEmbeddings()
        for dim, members in self.members.items():
            leaf = as_tensor(emb.rows[dim], device)
            if grad:
                leaf.requires_grad_()
            leaves[dim] = leaf
            bagged = self.pooled[dim]
            if bagged:
                block = self._pool_width(leaf, emb, dim)
                names = tuple(self.names[f] for f in bagged)
                pooled.blocks.append((names, block))
                for j, name in enumerate(names):
                    pooled[name] = block[:, j]
            sequences = [f for f in members if f in emb.sequences]
            if sequences:  # index -1 (past a sample's length) reads the zero row appended last
                padded = torch.cat([leaf, leaf.new_zeros(1, dim)])
                for f in sequences:
                    index, lengths = (as_tensor(a, device) for a in emb.sequences[f])
                    pooled[self.names[f]] = SeqEmbedding(padded[index], lengths)
        out = PooledEmbeddings({name: pooled[name] for name in self.names})
        out.blocks = pooled.blocks
        return leaves, out

    def pool_host(self, emb: BatchEmbeddings) -> PooledEmbeddings:
        """What `pool` makes of float32 host rows, as numpy arrays and without torch: each width's block of
        pooled features (by the same compiled kernel) and each sequence as (values, lengths). The inference
        service's compiled forward reads them as they are; at batch 1 torch's per-call overhead would be most
        of the pooling's cost."""
        from hybridrec.core.model.bag_kernels import pool_forward

        pooled = PooledEmbeddings()
        for dim, members in self.members.items():
            rows = np.ascontiguousarray(emb.rows[dim], dtype=np.float32)
            if self.pooled[dim]:
                feats = self._pooled_arrays[dim]
                block = np.empty((emb.batch_size, feats.size, dim), np.float32)
                pool_forward(rows, emb.pos, emb.lengths, emb.start, emb.base, feats, self.powers, block)
                pooled.blocks.append((tuple(self.names[f] for f in self.pooled[dim]), block))
            sequences = [f for f in members if f in emb.sequences]
            if sequences:  # index -1 (past a sample's length) reads the zero row appended last
                padded = np.concatenate([rows, np.zeros((1, dim), np.float32)])
                for f in sequences:
                    index, lengths = emb.sequences[f]
                    pooled[self.names[f]] = SeqEmbedding(padded[index], np.asarray(lengths, np.int64))
        return pooled

    def _pool_width(self, leaf: torch.Tensor, emb: BatchEmbeddings, dim: int) -> torch.Tensor:
        """(batch, pooled features of width `dim`, dim): every bag of the width's pooled features."""
        feats = self._pooled_arrays[dim]
        if leaf.device.type == "cpu" and leaf.dtype == torch.float32 and not isinstance(emb.pos, torch.Tensor):
            if leaf.requires_grad:
                return _KernelPool.apply(leaf, _Bags.of(emb, feats, self.powers))
            return _kernel_forward(leaf, _Bags.of(emb, feats, self.powers))
        return self._device_pool(leaf, emb, dim)

    def _device_pool(self, leaf: torch.Tensor, emb: BatchEmbeddings, dim: int) -> torch.Tensor:
        """`embedding_bag` over the width's bags, index and offsets built on the leaf's device from the frame's
        positions and lengths. Sizes come from the host's `start` and every array is staged or cached there,
        so nothing waits for the device; positions and lengths are widened to int64 before any indexing
        (CUDA indexes no uint16 tensor)."""
        device, feats = leaf.device, self._pooled_arrays[dim]
        pos, lengths = _as_long(as_tensor(emb.pos, device)), _as_long(as_tensor(emb.lengths, device))
        base = emb.device_base if emb.device_base is not None else torch.from_numpy(emb.base).to(device)
        spans = [(int(emb.start[f]), int(emb.start[f + 1])) for f in feats]
        total = sum(b - a for a, b in spans)
        first, last = int(feats[0]), int(feats[-1])
        if feats.size == last - first + 1:  # neighbours in config order: slices
            positions, bag_lengths, base = pos[spans[0][0]:spans[-1][1]], lengths[first:last + 1], base[first:last + 1]
        else:
            index = self._on_device(device, dim)[0]
            positions = torch.cat([pos[a:b] for a, b in spans])
            bag_lengths, base = lengths.index_select(0, index), base.index_select(0, index)
        index = positions + torch.repeat_interleave(base, bag_lengths.sum(1), output_size=total)
        bag_lengths = bag_lengths.reshape(-1)
        offsets = torch.cumsum(bag_lengths, 0) - bag_lengths
        weights = None
        if self.powers[feats].any():
            powers = self._on_device(device, dim)[1].repeat_interleave(emb.batch_size)
            per_bag = bag_lengths.clamp(min=1).to(leaf.dtype).pow(-powers)
            weights = torch.repeat_interleave(per_bag, bag_lengths, output_size=total)
        bags = F.embedding_bag(index, leaf, offsets, mode="sum", per_sample_weights=weights)
        return bags.view(feats.size, emb.batch_size, leaf.shape[1]).transpose(0, 1)

    def pool_padded(self, rows: dict[int, torch.Tensor], bags: dict[int, "PaddedBags"],
                    batch_size: int) -> tuple[dict[int, torch.Tensor], "PooledEmbeddings"]:
        """`pool` (with gradients) of a batch padded to a bucket's static shapes, the inputs of a captured step
        (services/nn_worker/captured.py): every shape depends on the bucket alone, so the same kernels run every
        step, and nothing in it reads a value back to the host. `rows[d]` holds width d's rows, zero rows after
        them; `bags[d]` its bags, padding elements last, which read the last (padding) row with weight 0, so the
        result and the real rows' gradients are `pool`'s and the padding rows' gradients are zeros. Pooled
        features only (a sequence is not captured)."""
        leaves: dict[int, torch.Tensor] = {}
        out = PooledEmbeddings()
        for dim in self.dims:
            leaf = rows[dim]
            leaf.requires_grad_()
            leaves[dim] = leaf
            names = tuple(self.names[f] for f in self.pooled[dim])
            block = self._padded_pool(leaf, bags[dim], dim, batch_size)
            out.blocks.append((names, block))
            for j, name in enumerate(names):
                out[name] = block[:, j]
        ordered = PooledEmbeddings({name: out[name] for name in self.names})
        ordered.blocks = out.blocks
        return leaves, ordered

    def _padded_pool(self, leaf: torch.Tensor, bags: "PaddedBags", dim: int, batch_size: int) -> torch.Tensor:
        """One width's padded bags pooled by a gather and an `index_add_`, not `embedding_bag`: on CUDA the
        latter's backward sorts the positions and reads a count back to the host, which a graph's capture
        refuses; these two and their backwards (each the other) read nothing back. The padding elements are one
        more run of `repeat_interleave` (their count last in `bags.counts`) and add, with weight 0, into one more
        bag, which is dropped."""
        feats, total = self._pooled_arrays[dim], bags.pos.shape[0]
        index = _as_long(bags.pos) + torch.repeat_interleave(bags.base, bags.counts, output_size=total)
        lengths = _as_long(bags.lengths).reshape(-1)
        bag_count = lengths.shape[0]
        with_padding = torch.cat([lengths, bags.counts[-1:]])
        bag = torch.repeat_interleave(torch.arange(bag_count + 1, device=leaf.device), with_padding,
                                      output_size=total)
        powers = self._on_device(leaf.device, dim)[1].repeat_interleave(batch_size)
        per_bag = lengths.clamp(min=1).to(leaf.dtype).pow(-powers)  # 1 for a sum (power 0)
        weights = torch.cat([per_bag, per_bag.new_zeros(1)]).index_select(0, bag)
        terms = leaf.index_select(0, index) * weights[:, None]
        pooled = leaf.new_zeros(bag_count + 1, leaf.shape[1]).index_add(0, bag, terms)[:bag_count]
        return pooled.view(feats.size, batch_size, leaf.shape[1]).transpose(0, 1)

    def _on_device(self, device: torch.device, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Width `dim`'s pooled feature indices and their pooling powers on `device`, copied there once (a copy
        from pageable host memory per step would make the host wait for the device)."""
        key = (device, dim)
        if key not in self._device_consts:
            feats = self._pooled_arrays[dim]
            self._device_consts[key] = (torch.from_numpy(feats).to(device),
                                        torch.from_numpy(self.powers[feats]).to(device))
        return self._device_consts[key]


class PaddedBags(NamedTuple):
    """One width's bags padded to a bucket (`Pooler.pool_padded`), as tensors of static shapes."""

    pos: torch.Tensor  # (elements,) uint16: each element's row within its feature; padding elements 0
    counts: torch.Tensor  # int64 (pooled features of the width + 1,): each feature's elements, then the padding's
    base: torch.Tensor  # int64 (pooled features + 1,): each feature's first row, then the padding row (the last)
    lengths: torch.Tensor  # (pooled features of the width, batch) bag lengths, uint16


_POWERS = {Pooling.SUM: 0.0, Pooling.MEAN: 1.0, Pooling.SQRTN: 0.5}


class _Bags(NamedTuple):
    """The host arrays one width's kernels read (`hybridrec.core.model.bag_kernels`)."""

    pos: np.ndarray
    lengths: np.ndarray
    start: np.ndarray
    base: np.ndarray
    feats: np.ndarray
    powers: np.ndarray
    batch_size: int

    @classmethod
    def of(cls, emb: BatchEmbeddings, feats: np.ndarray, powers: np.ndarray) -> "_Bags":
        return cls(emb.pos, emb.lengths, emb.start, emb.base, feats, powers, emb.batch_size)


def _kernel_forward(leaf: torch.Tensor, bags: _Bags) -> torch.Tensor:
    from hybridrec.core.model.bag_kernels import pool_forward  # numba: loaded by the first pooling, not at import

    out = np.empty((bags.batch_size, bags.feats.size, leaf.shape[1]), np.float32)
    pool_forward(leaf.detach().numpy(), bags.pos, bags.lengths, bags.start, bags.base, bags.feats, bags.powers, out)
    return torch.from_numpy(out)


class _KernelPool(torch.autograd.Function):
    """Pooling by `bag_kernels.pool_forward`, whose backward adds each bag's gradient into its rows in one
    compiled pass (`pool_backward`): one gradient per unique row, what goes back to the PS."""

    @staticmethod
    def forward(ctx, rows, bags: _Bags):
        ctx.bags, ctx.num_rows = bags, rows.shape[0]
        return _kernel_forward(rows, bags)

    @staticmethod
    def backward(ctx, grad):
        from hybridrec.core.model.bag_kernels import pool_backward

        bags = ctx.bags
        out = np.zeros((ctx.num_rows, grad.shape[2]), np.float32)
        pool_backward(np.ascontiguousarray(grad.numpy(), dtype=np.float32), bags.pos, bags.lengths, bags.start,
                      bags.base, bags.feats, bags.powers, out)
        return torch.from_numpy(out), None


def as_tensor(value: "np.ndarray | Fp16Rows | torch.Tensor", device: torch.device) -> torch.Tensor:
    """A host array (or a staged tensor) as a tensor on `device`; fp16 rows are scaled back there."""
    if isinstance(value, Fp16Rows):
        return unscale(as_tensor(value.half, device), as_tensor(value.norms, device), value.kappa)
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(value).to(device)


def _as_long(value: torch.Tensor) -> torch.Tensor:
    """int64 of positions or lengths as the frame carried them (uint16: read as int16 and masked, which every
    device supports)."""
    if value.dtype == torch.uint16:
        return value.view(torch.int16).long() & 0xFFFF
    return value.long()


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
