"""The two halves of a mini-batch on the wire (docs/architecture.md#one-training-batch, steps 1–2).

The data loader splits every batch: its ID features go to an embedding worker as
a `SparseBatch` (per feature: unique IDs, uint16 positions, bag lengths), its
dense features and labels go to an NN worker as a `DenseBatch` carrying the
`batch_ref` the embedding worker returned. The encoder lives with the decoder
here so the two ends cannot drift apart; the decoder validates everything an
untrusted sender could get wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridrec import codec
from hybridrec.compress import dedup

PHASES = ("train", "eval")

# batch_ref = embedding-worker index (8 bits) | worker incarnation (16 bits) | sequence (40 bits):
# the embedding worker makes refs, the NN worker routes each lookup by the top bits.
REF_SHIFT = 56
INCARNATION_SHIFT = 40


def make_batch_ref(worker: int, incarnation: int, seq: int) -> int:
    return (worker << REF_SHIFT) | (incarnation << INCARNATION_SHIFT) | seq


def worker_of_ref(ref: int) -> int:
    return ref >> REF_SHIFT


@dataclass
class SparseBatch:
    """ID features of one batch: feature f of sample i has bag uniq[f][pos[f][offsets[f][i]:offsets[f][i+1]]]."""

    batch_size: int
    uniq: list[np.ndarray]  # uint64 (U_f,)
    pos: list[np.ndarray]  # uint16 (nnz_f,)
    lengths: list[np.ndarray]  # uint16 (batch_size,)
    phase: str = "train"

    @classmethod
    def from_columns(cls, ids: np.ndarray, present: np.ndarray, *, phase: str) -> "SparseBatch":
        """From single-valued columns (n, F) with a presence mask (Criteo: one ID or none per field)."""
        uniq, pos, lengths = [], [], []
        for f in range(ids.shape[1]):
            mask = present[:, f]
            u, p = dedup(ids[mask, f])
            uniq.append(u)
            pos.append(p)
            lengths.append(mask.astype(np.uint16))
        return cls(batch_size=ids.shape[0], uniq=uniq, pos=pos, lengths=lengths, phase=phase)

    def encode(self, *, lz4: bool = True) -> bytes:
        tensors: dict[str, np.ndarray] = {}
        for f, (u, p, n) in enumerate(zip(self.uniq, self.pos, self.lengths)):
            tensors[f"u{f}"], tensors[f"p{f}"], tensors[f"n{f}"] = u, p, n
        compress = {name for name in tensors if name[0] in "pn"} if lz4 else set()
        return codec.encode(tensors, {"batch_size": self.batch_size, "phase": self.phase}, compress=compress)

    @classmethod
    def decode(cls, frame: codec.Frame, num_features: int) -> "SparseBatch":
        batch_size = frame.meta_int("batch_size")
        if not 0 < batch_size <= 65535:
            raise codec.FrameError(f"batch_size {batch_size} outside [1, 65535]")
        phase = frame.meta.get("phase", "train")
        if phase not in PHASES:
            raise codec.FrameError(f"phase {phase!r} is not one of {PHASES}")
        if len(frame.tensors) != 3 * num_features:
            raise codec.FrameError(f"expected {3 * num_features} tensors for {num_features} features, "
                                   f"got {len(frame.tensors)}")
        uniq, pos, lengths = [], [], []
        for f in range(num_features):
            u = frame.get(f"u{f}", np.uint64, 1)
            p = frame.get(f"p{f}", np.uint16, 1)
            n = frame.get(f"n{f}", np.uint16, 1)
            if n.shape[0] != batch_size:
                raise codec.FrameError(f"feature {f}: {n.shape[0]} bag lengths for a batch of {batch_size}")
            if int(n.sum(dtype=np.int64)) != p.shape[0]:
                raise codec.FrameError(f"feature {f}: bag lengths add up to {int(n.sum())}, "
                                       f"but {p.shape[0]} positions were sent")
            if p.size and int(p.max()) >= u.shape[0]:
                raise codec.FrameError(f"feature {f}: position {int(p.max())} outside {u.shape[0]} unique IDs")
            uniq.append(u)
            pos.append(p)
            lengths.append(n)
        return cls(batch_size=batch_size, uniq=uniq, pos=pos, lengths=lengths, phase=phase)


@dataclass
class DenseBatch:
    """Dense features and labels of one batch, and where its embeddings wait."""

    batch_ref: int
    dense: np.ndarray  # float32 (B, num_dense)
    labels: np.ndarray  # float32 (B,)
    phase: str = "train"
    seq: int = 0
    """Index of the batch in the job's training stream (all ranks together)."""
    position: tuple[int, ...] = ()
    """Where the data loader resumes reading after this batch (epoch, file, byte offset, line)."""

    def encode(self) -> bytes:
        return codec.encode({"dense": self.dense, "labels": self.labels},
                            {"batch_ref": self.batch_ref, "phase": self.phase, "seq": self.seq,
                             "position": list(self.position)})

    @classmethod
    def decode(cls, frame: codec.Frame, num_dense: int) -> "DenseBatch":
        dense = frame.get("dense", np.float32, 2)
        labels = frame.get("labels", np.float32, 1)
        if dense.shape[1] != num_dense or dense.shape[0] != labels.shape[0] or labels.shape[0] == 0:
            raise codec.FrameError(f"dense {dense.shape} and labels {labels.shape} do not form a batch with "
                                   f"{num_dense} dense features")
        phase = frame.meta.get("phase", "train")
        if phase not in PHASES:
            raise codec.FrameError(f"phase {phase!r} is not one of {PHASES}")
        position = frame.meta.get("position", [])
        if not isinstance(position, list) or not all(isinstance(v, int) and v >= 0 for v in position):
            raise codec.FrameError(f"position must be a list of non-negative integers, got {position!r}")
        return cls(batch_ref=frame.meta_int("batch_ref"), dense=dense, labels=labels, phase=phase,
                   seq=frame.meta_int("seq", default=0), position=tuple(position))
