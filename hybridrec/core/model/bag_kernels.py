"""Bag pooling on the CPU as compiled loops (`hybridrec.core.model.pooling`): forward and backward, straight from the
`Embeddings` frame's arrays.

Why not `F.embedding_bag`: it wants one int64 row index per bag element and one offset per bag, which the
NN worker would first build from the frame's uint16 positions, per-feature row bases and bag lengths (several
O(elements) numpy passes per step), and its output is feature-major, (features x batch, width), which the
dense model then transposes and concatenates. Its CPU backward also sorts the elements by row before adding
them up (25.7 ms per step for a 4,096-sample Criteo batch on the development machine, against 1.3 ms for one
pass that adds each bag's gradient into its rows).

These kernels read the frame's arrays as they came — positions (uint16 from the wire, int64 from the
inference service), bag lengths (features x batch), each feature's first element and first row — and write
the pooled vectors sample-major, (batch, features, width): the layout the dense model takes without a copy
(`hybridrec.core.model.pooling.PooledEmbeddings`). A bag of n elements is divided by n to its feature's power (0: sum,
1: mean, 0.5: sqrt-n pooling), so no per-element weights are built either.
"""
from __future__ import annotations

import numpy as np

from hybridrec.core.runtime.kernel_cache import njit


@njit(nogil=True, cache=True)
def pool_forward(rows, pos, lengths, start, base, feats, powers, out):
    """out[s, j] = n ** -powers[f] * sum of rows[base[f] + pos[e]] over the n elements e of feature
    f = feats[j] in sample s. `start[f]` is feature f's first element in `pos`; its bags follow in sample
    order, each `lengths[f, s]` long. `out` is (batch, len(feats), width), written in order (sample-major:
    a feature-major walk would touch a new cache line of `out` at every bag)."""
    batch, width, count = lengths.shape[1], rows.shape[1], feats.shape[0]
    cursor = np.empty(count, np.int64)  # each feature's next element
    for j in range(count):
        cursor[j] = start[feats[j]]
    for s in range(batch):
        for j in range(count):
            f = feats[j]
            n = np.int64(lengths[f, s])
            e = cursor[j]
            for c in range(width):
                out[s, j, c] = 0.0
            for k in range(n):
                r = base[f] + np.int64(pos[e + k])
                for c in range(width):
                    out[s, j, c] += rows[r, c]
            if powers[f] != 0 and n > 1:
                w = np.float32(n) ** -powers[f]
                for c in range(width):
                    out[s, j, c] *= w
            cursor[j] = e + n


@njit(nogil=True, cache=True)
def pool_backward(grad, pos, lengths, start, base, feats, powers, out):
    """The gradient of `pool_forward` with respect to `rows`: out[base[f] + pos[e]] += n ** -power * grad[s, j]
    for every element e of every bag (feature f = feats[j], sample s). `out` is zeroed by the caller."""
    batch, width, count = lengths.shape[1], out.shape[1], feats.shape[0]
    cursor = np.empty(count, np.int64)
    for j in range(count):
        cursor[j] = start[feats[j]]
    for s in range(batch):
        for j in range(count):
            f = feats[j]
            n = np.int64(lengths[f, s])
            e = cursor[j]
            w = np.float32(n) ** -powers[f] if powers[f] != 0 and n > 1 else np.float32(1.0)
            for k in range(n):
                r = base[f] + np.int64(pos[e + k])
                for c in range(width):
                    out[r, c] += w * grad[s, j, c]
            cursor[j] = e + n


def warm_up() -> None:
    """Load both kernels (numba's on-disk cache, or a compilation) for a frame's argument types: uint16
    positions and lengths, int64 starts, bases and feature indices; positions and lengths read-only (views of
    a received frame's bytes) and writable (a batch assembled in memory). The dense fork server calls it, so
    that no NN worker pays numba's start-up (about a CPU-second each) at its first step, nor compiles a kernel
    once it serves."""
    rows = np.zeros((2, 4), np.float32)
    pos, lengths = np.zeros(2, np.uint16), np.ones((1, 2), np.uint16)
    start, base, feats = np.array([0, 2], np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    powers = np.zeros(1, np.float32)
    pooled = np.empty((2, 1, 4), np.float32)
    for writable in (True, False):
        pos.setflags(write=writable)
        lengths.setflags(write=writable)
        pool_forward(rows, pos, lengths, start, base, feats, powers, pooled)
        pool_backward(pooled, pos, lengths, start, base, feats, powers, np.zeros_like(rows))

