"""Pooling of a feature's bags and its inverse, as compiled loops (run on the embedding worker).

`pool` turns the rows of a batch's unique IDs into one vector per sample and
feature; `unpool` sends the pooled gradient back to the rows, summing the
contributions of every occurrence of an ID — the per-unique-ID aggregation the
PS update needs. Both are O(total bag length × width) and allocate nothing.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hybridrec.config import Pooling

MODE_CODES = {Pooling.SUM: 0, Pooling.MEAN: 1, Pooling.SQRTN: 2}


@njit(nogil=True, cache=True)
def _bag_scale(n: int, mode: int) -> float:
    if n == 0 or mode == 0:
        return 1.0
    if mode == 1:
        return 1.0 / n
    return 1.0 / np.sqrt(n)


@njit(nogil=True, cache=True)
def pool(rows: np.ndarray, idx: np.ndarray, lengths: np.ndarray, mode: int, out: np.ndarray) -> None:
    """out[i] = scale(len_i) * sum of rows[idx[k]] over sample i's bag; out may be a column slice."""
    dim = rows.shape[1]
    p = 0
    for i in range(lengths.shape[0]):
        n = lengths[i]
        for j in range(dim):
            out[i, j] = 0.0
        for k in range(p, p + n):
            r = idx[k]
            for j in range(dim):
                out[i, j] += rows[r, j]
        if n > 0 and mode != 0:
            s = _bag_scale(n, mode)
            for j in range(dim):
                out[i, j] *= s
        p += n


@njit(nogil=True, cache=True)
def unpool(grad: np.ndarray, idx: np.ndarray, lengths: np.ndarray, mode: int, out: np.ndarray) -> None:
    """out[idx[k]] += scale(len_i) * grad[i] for every occurrence k in sample i's bag (out pre-zeroed)."""
    dim = out.shape[1]
    p = 0
    for i in range(lengths.shape[0]):
        n = lengths[i]
        s = _bag_scale(n, mode)
        for k in range(p, p + n):
            r = idx[k]
            for j in range(dim):
                out[r, j] += s * grad[i, j]
        p += n
