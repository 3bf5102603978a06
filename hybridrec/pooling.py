"""Pooling of embedding bags for the dense model: one code path for training and serving.

The NN worker decodes a batch's embeddings (`Pooler.decode`) and pools them
differentiably; the inference service builds the same bag structure from a
request's ID columns (`Pooler.from_columns`) and pools with the same
`Pooler.pool`, so a served prediction is computed exactly as in training.

The embedding worker sends each feature's unique rows (grouped by width, the
features of a width concatenated in config order), the uint16 position of every
bag element in its feature's rows, and every bag's length. Pooling happens here,
with one `embedding_bag` call per width over all (feature, sample) bags, so the
backward pass yields exactly one gradient per unique row — what goes back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hybridrec.compress import ValueCodec
from hybridrec.config import FeatureConfig, Pooling
from hybridrec.frames import Embeddings


@dataclass
class BatchEmbeddings:
    """One batch's embeddings as received: rows per width plus the bag structure to pool them."""

    batch_size: int
    rows: dict[int, np.ndarray]  # width -> (unique rows of its features, width) float32
    index: dict[int, np.ndarray]  # width -> int64 row of every bag element, features of that width in order
    offsets: dict[int, np.ndarray]  # width -> int64 start of every (feature, sample) bag
    weights: dict[int, np.ndarray | None]  # width -> per-element weights (mean / sqrt-n pooling) or None


class Pooler:
    def __init__(self, features: list[FeatureConfig], values: ValueCodec):
        self.features, self.values = features, values
        self.dims = sorted({f.dim for f in features})
        self.members = {d: [i for i, f in enumerate(features) if f.dim == d] for d in self.dims}
        self.names = [f.name for f in features]
        self.widths = [f.dim for f in features]
        self.weighted = any(f.pooling != Pooling.SUM for f in features)

    def decode(self, frame_bytes: bytes, batch_size: int) -> BatchEmbeddings:
        """Decode (and validate) an `Embeddings` frame into the bag structure `pool` needs."""
        frame = Embeddings.decode(frame_bytes, self.values, self.widths, batch_size)
        nnz = frame.lengths.sum(axis=1, dtype=np.int64)
        pos_start = np.concatenate([[0], np.cumsum(nnz)])
        out = BatchEmbeddings(batch_size, {}, {}, {}, {})
        for dim, members in self.members.items():
            row_start = np.concatenate([[0], np.cumsum(frame.counts[members], dtype=np.int64)])
            index, bag_lengths, weights = [], [], []
            for k, f in enumerate(members):
                index.append(frame.pos[pos_start[f]:pos_start[f + 1]].astype(np.int64) + row_start[k])
                bag_lengths.append(frame.lengths[f])
                if self.weighted:
                    weights.append(_bag_weights(frame.lengths[f], self.features[f].pooling))
            bags = np.concatenate(bag_lengths).astype(np.int64)
            out.rows[dim] = frame.rows[dim]
            out.index[dim] = np.concatenate(index)
            out.offsets[dim] = np.cumsum(bags) - bags
            out.weights[dim] = np.concatenate(weights) if self.weighted else None
        return out

    def from_columns(self, ids: np.ndarray, present: np.ndarray) -> tuple[dict[int, np.ndarray], BatchEmbeddings]:
        """Bags of single-valued ID columns (n, F) with a presence mask (Criteo: one ID or none per field).

        Returns the unique IDs of each width (all features of that width
        together: what to look up) and the bag structure with `rows` left
        empty; put each width's looked-up rows, in the order of its unique IDs,
        into `rows` before `pool`. An absent field is an empty bag (pooled
        zeros), as in training (`SparseBatch.from_columns`).
        """
        batch_size = ids.shape[0]
        uniq: dict[int, np.ndarray] = {}
        out = BatchEmbeddings(batch_size, {}, {}, {}, {})
        for dim, members in self.members.items():
            cols = ids[:, members].T  # (features of this width, batch): bags in (feature, sample) order
            mask = present[:, members].T
            u, inverse = np.unique(cols[mask], return_inverse=True)
            lengths = mask.reshape(-1).astype(np.int64)
            uniq[dim] = u
            out.index[dim] = inverse.reshape(-1).astype(np.int64)
            out.offsets[dim] = np.cumsum(lengths) - lengths
            out.weights[dim] = (np.concatenate([_bag_weights(mask[k].astype(np.uint16), self.features[f].pooling)
                                                for k, f in enumerate(members)]) if self.weighted else None)
        return uniq, out

    def empty(self, batch_size: int) -> BatchEmbeddings:
        """Embeddings of a batch whose every bag is empty (pooled zeros): the stand-in for a lost batch."""
        return BatchEmbeddings(
            batch_size,
            rows={d: np.zeros((0, d), np.float32) for d in self.dims},
            index={d: np.zeros(0, np.int64) for d in self.dims},
            offsets={d: np.zeros(len(m) * batch_size, np.int64) for d, m in self.members.items()},
            weights={d: (np.zeros(0, np.float32) if self.weighted else None) for d in self.dims},
        )

    def pool(self, emb: BatchEmbeddings, device: torch.device, *, grad: bool):
        """(leaf tensor of rows per width, pooled embedding per feature name)."""
        leaves: dict[int, torch.Tensor] = {}
        pooled: dict[str, torch.Tensor] = {}
        for dim, members in self.members.items():
            leaf = torch.from_numpy(emb.rows[dim]).to(device)
            if grad:
                leaf.requires_grad_()
            leaves[dim] = leaf
            weights = emb.weights[dim]
            bags = F.embedding_bag(torch.from_numpy(emb.index[dim]).to(device), leaf,
                                   torch.from_numpy(emb.offsets[dim]).to(device), mode="sum",
                                   per_sample_weights=None if weights is None else torch.from_numpy(weights).to(device))
            bags = bags.view(len(members), emb.batch_size, dim)
            for k, f in enumerate(members):
                pooled[self.names[f]] = bags[k]
        return leaves, {name: pooled[name] for name in self.names}


def _bag_weights(lengths: np.ndarray, pooling: Pooling) -> np.ndarray:
    n = lengths.astype(np.float32)
    if pooling == Pooling.SUM:
        per_bag = np.ones_like(n)
    elif pooling == Pooling.MEAN:
        per_bag = 1.0 / np.maximum(n, 1)
    else:
        per_bag = 1.0 / np.sqrt(np.maximum(n, 1))
    return np.repeat(per_bag, lengths.astype(np.int64))
