"""The backward pass of bag pooling on CPU, as a compiled loop (`hybridrec.pooling`'s `bag_sum`).

Why not autograd's own: `F.embedding_bag`'s CPU backward sorts the bag
elements by row before it adds them up; for a 4,096-sample batch of 26
features (about 90,000 elements into about 50,000 unique rows) it took
25.7 ms per step on the development machine, a quarter of the NN worker's
time outside the MLP. Adding each bag's gradient into its elements' rows in
one pass takes 1.3 ms.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def bag_grad_rows(grad_bags: np.ndarray, index: np.ndarray, offsets: np.ndarray, weights: np.ndarray,
                  out: np.ndarray) -> None:
    """out[index[k]] += weights[k] * grad_bags[b] for every element k of every bag b (`weights` empty:
    1). Bag b holds elements offsets[b] up to offsets[b + 1] (the last bag: up to the end); `out` is zeroed."""
    n = index.shape[0]
    nb = offsets.shape[0]
    dim = out.shape[1]
    weighted = weights.shape[0] > 0
    for b in range(nb):
        end = offsets[b + 1] if b + 1 < nb else n
        for k in range(offsets[b], end):
            r = index[k]
            if weighted:
                w = weights[k]
                for j in range(dim):
                    out[r, j] += w * grad_bags[b, j]
            else:
                for j in range(dim):
                    out[r, j] += grad_bags[b, j]
