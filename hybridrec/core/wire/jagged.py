"""The jagged form of a batch's sparse features: every sample's IDs as a variable-length list.

`KeyedBags` holds every feature of a batch in one pair of arrays (the part
TorchRec's KeyedJaggedTensor plays); `Bag` is one feature of it (flat values
and offsets). A scalar feature is a bag of at most one ID per sample (an
absent field is an empty list), a multi-hot feature a bag of any length, a
sequence a bag in the data's order (oldest first). Every reader of the data
loader makes a KeyedBags (TSV columns through `KeyedBags.from_columns`), and
so does the inference service's input decoder; the frames carry it, and
`hybridrec.core.model.pooling.Pooler` plans and pools it for training and serving alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np


@dataclass
class Bag:
    """One feature of a batch as variable-length lists: sample i's IDs are values[offsets[i]:offsets[i + 1]],
    in the data's order (a sequence's oldest first)."""

    values: np.ndarray  # uint64 (nnz,)
    offsets: np.ndarray  # int64 (n + 1,), offsets[0] == 0
    known_lengths: np.ndarray | None = field(default=None, repr=False, compare=False)
    """The lengths when whoever made the bag had them already (None: computed on first use)."""

    @property
    def lengths(self) -> np.ndarray:
        """int64 (n,): each sample's count (computed once: a bag is not changed after it is made)."""
        if self.known_lengths is None:
            self.known_lengths = np.diff(self.offsets)
        return self.known_lengths

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def slice(self, start: int, stop: int) -> "Bag":
        offsets = self.offsets[start:stop + 1]
        return Bag(self.values[offsets[0]:offsets[-1]], offsets - offsets[0])

    @staticmethod
    def from_column(ids: np.ndarray, present: np.ndarray) -> "Bag":
        """A scalar feature given as one ID per sample and whether it is there."""
        offsets = np.zeros(present.shape[0] + 1, np.int64)
        np.cumsum(present, out=offsets[1:])
        return Bag(np.ascontiguousarray(ids[present], dtype=np.uint64), offsets)

    @staticmethod
    def from_lengths(values: np.ndarray, lengths: np.ndarray, present: np.ndarray | None = None) -> "Bag":
        """Flat values and each sample's count; values not `present` (a null element, an empty string) are
        dropped and their samples' counts shrink, as the readers and the inference decoder both want."""
        offsets = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if present is not None and not present.all():
            kept = np.concatenate([[0], np.cumsum(present)])
            offsets, values = kept[offsets], values[present]
            return Bag(np.ascontiguousarray(values, dtype=np.uint64), offsets)
        return Bag(np.ascontiguousarray(values, dtype=np.uint64), offsets,
                   lengths if lengths.dtype == np.int64 else None)  # the lengths as given, not diffed again

    def keep_last(self, max_len: int) -> tuple["Bag", np.ndarray]:
        """Every sample's last `max_len` IDs (a sequence is oldest first: the most recent are kept), and which
        samples were cut."""
        lengths = self.lengths
        over = lengths > max_len
        if not over.any():
            return self, over
        new_lengths = np.minimum(lengths, max_len)
        new_offsets = np.zeros_like(self.offsets)
        np.cumsum(new_lengths, out=new_offsets[1:])
        index = _runs(self.offsets[1:] - new_lengths, new_lengths)  # each sample's last new_lengths values
        return Bag(self.values[index], new_offsets), over


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The int64 index of runs values[starts[k]:starts[k] + lengths[k]], one after another: a gather of many
    slices in one numpy call, not a Python loop over them."""
    ends = np.cumsum(lengths, dtype=np.int64)
    return np.arange(int(ends[-1]) if ends.size else 0) + np.repeat(starts - (ends - lengths), lengths)


@dataclass
class KeyedBags:
    """Every sparse feature of a batch in one pair of arrays: TorchRec's KeyedJaggedTensor, keys in config order.

    `values` holds feature 0's bags of every sample, then feature 1's, and so
    on (feature-major); `lengths[f, i]` counts sample i's values of feature f.
    The values are IDs (uint64) as a reader or the inference decoder made
    them, or int64 row indices where the pooler plans a batch
    (`hybridrec.core.model.pooling`). A batch costs a few whole-array operations however
    many features it has: a batch-1 request with 26 features makes no
    per-feature Python objects unless it asks for one (`bag`).
    """

    values: np.ndarray  # (nnz,) feature-major
    lengths: np.ndarray  # integers (F, n): int64, or uint16 as frames carry them

    def __len__(self) -> int:
        return int(self.lengths.shape[1])

    @property
    def num_features(self) -> int:
        return int(self.lengths.shape[0])

    @cached_property
    def bounds(self) -> np.ndarray:
        """int64 (F + 1,): feature f's values are values[bounds[f]:bounds[f + 1]] (computed once: a
        KeyedBags is not changed after it is made)."""
        bounds = np.zeros(self.num_features + 1, np.int64)
        # uint16 lengths of at most 65537 samples cannot overflow a uint32 sum, which numpy does 2.4x faster
        narrow = self.lengths.dtype == np.uint16 and self.lengths.shape[1] <= 65537
        np.cumsum(self.lengths.sum(axis=1, dtype=np.uint32 if narrow else np.int64), out=bounds[1:])
        return bounds

    @cached_property
    def starts(self) -> np.ndarray:
        """int64 (F, n + 1): sample i's values of feature f are values[starts[f, i]:starts[f, i + 1]]."""
        starts = np.zeros((self.num_features, len(self) + 1), np.int64)
        np.cumsum(self.lengths, axis=1, dtype=np.int64, out=starts[:, 1:])
        starts += self.bounds[:-1, None]
        return starts

    def slice(self, start: int, stop: int) -> "KeyedBags":
        """Samples start..stop-1 (one gather of each feature's contiguous run of values)."""
        first, last = self.starts[:, start], self.starts[:, stop]
        return KeyedBags(self.values[_runs(first, last - first)], self.lengths[:, start:stop])

    def take(self, rows: np.ndarray) -> "KeyedBags":
        """Samples `rows` (indices, in the order given): one gather of their runs of values, feature-major."""
        lengths = self.lengths[:, rows]
        first = self.starts[:, :-1][:, rows]
        return KeyedBags(self.values[_runs(first.reshape(-1), lengths.reshape(-1).astype(np.int64))], lengths)

    def bag(self, f: int) -> Bag:
        """Feature f alone (views of these arrays)."""
        bounds = self.bounds
        offsets = np.zeros(len(self) + 1, np.int64)
        np.cumsum(self.lengths[f], dtype=np.int64, out=offsets[1:])
        return Bag(self.values[bounds[f]:bounds[f + 1]], offsets, self.lengths[f])

    def bags(self) -> list[Bag]:
        return [self.bag(f) for f in range(self.num_features)]

    @staticmethod
    def from_bags(bags: Sequence[Bag]) -> "KeyedBags":
        if not bags:
            return KeyedBags(np.zeros(0, np.uint64), np.zeros((0, 0), np.int64))
        values = np.concatenate([b.values for b in bags]) if len(bags) > 1 else bags[0].values
        return KeyedBags(values, np.stack([b.lengths for b in bags]).astype(np.int64, copy=False))

    @staticmethod
    def from_columns(ids: np.ndarray, present: np.ndarray) -> "KeyedBags":
        """Single-valued columns (n, F) with a presence mask (Criteo: one ID or none per field): each feature is
        a bag of at most one ID."""
        mask = np.ascontiguousarray(present.T)
        return KeyedBags(np.ascontiguousarray(ids.T, dtype=np.uint64)[mask], mask.astype(np.int64))

    def to_columns(self, absent: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids (n, F), present (n, F)) of bags of at most one ID each (the TSV column layout), an empty bag's
        ID `absent[f]` (0 by default); ValueError if a bag holds more."""
        if self.lengths.size and int(self.lengths.max()) > 1:
            raise ValueError("bags of more than one ID have no column form")
        present = self.lengths.astype(bool)
        ids = np.zeros(present.shape, np.uint64)
        if absent is not None:
            ids[:] = np.asarray(absent, np.uint64)[:, None]
        ids[present] = self.values  # feature-major, as the mask is walked
        return np.ascontiguousarray(ids.T), np.ascontiguousarray(present.T)

    @staticmethod
    def concat(parts: Sequence["KeyedBags"]) -> "KeyedBags":
        """The samples of `parts`, in order (the inference batcher merging requests): one gather of every
        part's values into feature-major order, not a slice per part and feature."""
        if len(parts) == 1:
            return parts[0]
        bounds = np.stack([p.bounds for p in parts])  # (parts, F + 1)
        nnz = np.diff(bounds, axis=1)  # each feature's values in each part
        starts = bounds[:, :-1] + (np.cumsum(bounds[:, -1]) - bounds[:, -1])[:, None]  # ... where they begin
        index = _runs(starts.T.reshape(-1), nnz.T.reshape(-1))  # (feature, part) runs, feature-major
        values = np.concatenate([p.values for p in parts])[index]
        return KeyedBags(values, np.concatenate([p.lengths for p in parts], axis=1))
