"""Gradient aggregation on the embedding worker, as a compiled loop.

The NN worker pools (it receives each feature's unique rows and positions, so
rows travel once per batch however often an ID repeats) and returns one
gradient per feature-unique row. Features of one width can share IDs (a
feature group used twice), so the worker sums those rows into one gradient per
batch-unique ID before the PS update: `scatter_add_rows`.
"""
from __future__ import annotations

import numpy as np

from hybridrec.core.runtime.kernel_cache import njit


@njit(nogil=True, cache=True)
def scatter_add_rows(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """out[idx[k]] += src[k] for every row k (out pre-zeroed; idx may repeat)."""
    dim = out.shape[1]
    for k in range(idx.shape[0]):
        r = idx[k]
        for j in range(dim):
            out[r, j] += src[k, j]
