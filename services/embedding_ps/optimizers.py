"""Embedding optimizers of the PS: their state layout and arithmetic.

On the embedding PS: every row of a store holds its embedding followed by the
optimizer state (`state_width(dim)` float32 values). `apply_stripe` updates
the rows of one stripe in place while the store holds that stripe's lock
(numba, nogil). Its numba code only calls functions of this module and of
row_storage.py (a store's 16-bit weights, decoded before the step and written
back with stochastic rounding after it): numba's on-disk cache notices edits
to the defining file only.

The arithmetic is float32 in torch's operation order (SGD, Adagrad with
lr_decay=0, Adam with L2 weight decay), so a row matches torch.optim on the
same tensor within an ulp; Adam keeps a per-row step because rows are updated
sparsely. FTRL follows TensorFlow's ApplyFtrl (float64 math). Row-wise Adagrad
is FBGEMM's: one accumulator per row, of the mean over the row of the squared
gradient, so its state is one value whatever the width.

The optimizer and its hyper-parameters are `EmbeddingOptimizerConfig`
(hybridrec/core/config/optimizers.py), used as it is: the functions at the end of this module
give its kernel code, state widths and hyper-parameter vector.
"""
from __future__ import annotations

import math

import numpy as np

from hybridrec.core.config import EmbeddingOptimizer, EmbeddingOptimizerConfig
from hybridrec.core.runtime.kernel_cache import njit
from services.embedding_ps.row_storage import decode_row16, encode_row16, mix64, prefetch

OPT_SGD, OPT_ADAGRAD, OPT_ADAM, OPT_FTRL, OPT_ROWWISE_ADAGRAD = 0, 1, 2, 3, 4
OPTIMIZER_CODES: dict[EmbeddingOptimizer, int] = {
    EmbeddingOptimizer.SGD: OPT_SGD, EmbeddingOptimizer.ADAGRAD: OPT_ADAGRAD,
    EmbeddingOptimizer.ADAM: OPT_ADAM, EmbeddingOptimizer.FTRL: OPT_FTRL,
    EmbeddingOptimizer.ROWWISE_ADAGRAD: OPT_ROWWISE_ADAGRAD,
}
"""The kernel's code of each optimizer. Every store header records it: a code never changes meaning."""
# Layout of the float64 hyper-parameter vector `hp` the kernel reads.
HP_LR, HP_EPS, HP_BETA1, HP_BETA2, HP_ADAM_EPS, HP_WD, HP_LR_POWER, HP_L1, HP_L2, HP_BOUND = range(10)
NUM_HP = 10


@njit(inline="always", error_model="numpy")
def _clip(w, bound):
    if w > bound:
        return bound
    if w < -bound:
        return -bound
    return w


@njit(inline="always", error_model="numpy")
def _sum_of_squares(row, g_row, dim, wd):
    """Sum over the row of (g + wd * w)**2, in four interleaved partial sums.

    One running float32 sum is a chain of dependent additions that LLVM may not
    reorder (float addition is not associative), so it costs an addition's
    latency per element; four independent sums overlap (row-wise Adagrad's
    update measured 1.15-1.2x faster at width 16). The order differs from a
    single sum's by an ulp or so of the row's mean, as FBGEMM's vector sums do.
    """
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    d = 0
    while d + 4 <= dim:
        g0 = g_row[d] + wd * row[d]
        g1 = g_row[d + 1] + wd * row[d + 1]
        g2 = g_row[d + 2] + wd * row[d + 2]
        g3 = g_row[d + 3] + wd * row[d + 3]
        s0 += g0 * g0
        s1 += g1 * g1
        s2 += g2 * g2
        s3 += g3 * g3
        d += 4
    while d < dim:
        g = g_row[d] + wd * row[d]
        s0 += g * g
        d += 1
    return (s0 + s1) + (s2 + s3)


@njit(inline="always", error_model="numpy")
def _apply_row(row, g_row, dim, sgd, adagrad, adam, ftrl, rowwise, bounded):
    """One optimizer step on one row, float32 arithmetic in torch's operation order.

    The optimizer is the argument that is not None, the hyper-parameter vector `hp` (`kernel_rule`): numba
    drops the branches of the four that are None before it types them, so a store compiles only its own
    optimizer's code (five optimizers' code was most of the update kernel's compile on a cold start).
    torch computes `param.addcdiv_(g, std, value=-lr)` as param + ((-lr) * g) / std,
    `state.addcmul_(g, g, value=c)` as state + (c * g) * g, and casts Python
    float hyper-parameters to float32; doing the same keeps us within an ulp.
    """
    if sgd is not None:
        _sgd_row(row, g_row, dim, sgd, bounded)
    elif adagrad is not None:
        _adagrad_row(row, g_row, dim, adagrad, bounded)
    elif rowwise is not None:
        _rowwise_adagrad_row(row, g_row, dim, rowwise, bounded)
    elif adam is not None:
        _adam_row(row, g_row, dim, adam, bounded)
    elif ftrl is not None:
        _ftrl_row(row, g_row, dim, ftrl, bounded)


@njit(inline="always", error_model="numpy")
def _sgd_row(row, g_row, dim, hp, bounded):
    lr = np.float32(hp[HP_LR])
    wd = np.float32(hp[HP_WD])
    bound = np.float32(hp[HP_BOUND])
    for d in range(dim):
        w = row[d]
        g = g_row[d] + wd * w
        w = w + (-lr) * g
        row[d] = _clip(w, bound) if bounded else w


@njit(inline="always", error_model="numpy")
def _adagrad_row(row, g_row, dim, hp, bounded):
    lr = np.float32(hp[HP_LR])
    wd = np.float32(hp[HP_WD])
    bound = np.float32(hp[HP_BOUND])
    eps = np.float32(hp[HP_EPS])
    for d in range(dim):
        w = row[d]
        g = g_row[d] + wd * w
        acc = row[dim + d] + g * g
        row[dim + d] = acc
        w = w + ((-lr) * g) / (np.sqrt(acc) + eps)
        row[d] = _clip(w, bound) if bounded else w


@njit(inline="always", error_model="numpy")
def _rowwise_adagrad_row(row, g_row, dim, hp, bounded):
    """State: [sum of the row's mean squared gradients]."""
    lr = np.float32(hp[HP_LR])
    wd = np.float32(hp[HP_WD])
    bound = np.float32(hp[HP_BOUND])
    eps = np.float32(hp[HP_EPS])
    acc = row[dim] + _sum_of_squares(row, g_row, dim, wd) / np.float32(dim)
    row[dim] = acc
    step = (-lr) / (np.sqrt(acc) + eps)
    for d in range(dim):
        w = row[d]
        w = w + step * (g_row[d] + wd * w)
        row[d] = _clip(w, bound) if bounded else w


@njit(inline="always", error_model="numpy")
def _adam_row(row, g_row, dim, hp, bounded):
    """State: [exp_avg | exp_avg_sq | step]."""
    wd = np.float32(hp[HP_WD])
    bound = np.float32(hp[HP_BOUND])
    beta1 = hp[HP_BETA1]
    beta2 = hp[HP_BETA2]
    step = row[3 * dim] + np.float32(1.0)  # float32 step saturates at 2**24, where bias correction is 1
    row[3 * dim] = step
    step_size = np.float32(hp[HP_LR] / (1.0 - beta1 ** np.float64(step)))
    bc2_sqrt = np.float32(math.sqrt(1.0 - beta2 ** np.float64(step)))
    c1 = np.float32(1.0 - beta1)
    b2 = np.float32(beta2)
    c2 = np.float32(1.0 - beta2)
    eps = np.float32(hp[HP_ADAM_EPS])
    small = c1 < np.float32(0.5)
    for d in range(dim):
        w = row[d]
        g = g_row[d] + wd * w
        m = row[dim + d]
        # torch exp_avg.lerp_(g, 1 - beta1), whose formula depends on the weight
        m = m + c1 * (g - m) if small else g - (g - m) * (np.float32(1.0) - c1)
        v = row[2 * dim + d] * b2 + (c2 * g) * g
        row[dim + d] = m
        row[2 * dim + d] = v
        w = w + ((-step_size) * m) / (np.sqrt(v) / bc2_sqrt + eps)
        row[d] = _clip(w, bound) if bounded else w


@njit(inline="always", error_model="numpy")
def _ftrl_row(row, g_row, dim, hp, bounded):
    """FTRL-proximal as TensorFlow's ApplyFtrl, in float64; state: [accum | linear]."""
    bound = np.float32(hp[HP_BOUND])
    lr64 = hp[HP_LR]
    p = -hp[HP_LR_POWER]
    l1 = hp[HP_L1]
    l2 = hp[HP_L2]
    for d in range(dim):
        w = np.float64(row[d])
        g = np.float64(g_row[d]) + hp[HP_WD] * w
        acc = np.float64(row[dim + d])
        acc_new = acc + g * g
        lin = np.float64(row[2 * dim + d]) + g - (acc_new ** p - acc ** p) / lr64 * w
        quad = acc_new ** p / lr64 + 2.0 * l2
        w = (math.copysign(l1, lin) - lin) / quad if abs(lin) > l1 else 0.0
        row[dim + d] = np.float32(acc_new)
        row[2 * dim + d] = np.float32(lin)
        row[d] = _clip(np.float32(w), bound) if bounded else np.float32(w)


@njit(nogil=True, cache=True, error_model="numpy")
def apply_stripe(perm, lo, hi, slots, grads, values, sgd, adagrad, adam, ftrl, rowwise, bounded, dim, storage,
                 ids, round_key):
    """One step on row slots[j] with gradient grads[perm[j]], for j in [lo, hi) with a slot; returns rows applied.

    `sgd, adagrad, adam, ftrl, rowwise`: the store's optimizer's hyper-parameters in its place, None in the
    others' (`kernel_rule`); `bounded`: the hyper-parameters hold a weight bound (not NaN).
    `dim` is passed in rather than read from grads.shape, and the numpy error
    model (no ZeroDivisionError checks) is used: either one kept LLVM from
    vectorising the per-row loops (measured 6x slower).
    A store of 16-bit weights (`storage` not FP32) has them decoded into a float32 row, stepped there, and
    written back rounded at random from (round_key, the row's key ids[perm[j]], position): see row_storage.py.
    """
    applied = 0
    if storage is None:
        for j in range(lo, hi):
            s = slots[j]
            if s >= 0:
                _apply_row(values[s], grads[perm[j]], dim, sgd, adagrad, adam, ftrl, rowwise, bounded)
                applied += 1
        return applied
    return _apply_compact(perm, lo, hi, slots, grads, values, sgd, adagrad, adam, ftrl, rowwise, bounded, dim,
                          storage, ids, round_key)


_BLOCK = 64
"""Rows a 16-bit store's update gathers, steps and scatters at a time."""


@njit(inline="always", error_model="numpy")
def _next_block(slots, perm, j, hi, at, src):
    """The next rows with a slot from position j: at[:k] their slots, src[:k] their rows of the batch (perm[j]);
    returns (k, the position after them)."""
    k = 0
    while j < hi and k < _BLOCK:
        s = slots[j]
        if s >= 0:
            at[k] = s
            src[k] = perm[j]
            k += 1
        j += 1
    return k, j


@njit(inline="always", error_model="numpy")
def _apply_compact(perm, lo, hi, slots, grads, values, sgd, adagrad, adam, ftrl, rowwise, bounded, dim, storage,
                   ids, round_key):
    """`apply_stripe` on 16-bit weights, a block of rows at a time, the next block's rows fetched meanwhile.

    Before a block is stepped, the rows of the next one are asked of the memory (`prefetch`: both lines of a
    row that straddles two), so that their cache misses (a large table's rows lie at random) are served while
    this block's arithmetic runs instead of after it. Then each block's gradient rows, stored words and keys
    (the IDs of the batch, not the store's key array: one cache miss less a row) are copied to local buffers,
    each row is decoded into float32 (`decode_row16`), stepped by `_apply_row`, encoded back with stochastic
    rounding (`encode_row16`), and the block's rows are written back. Without the prefetch a block's misses
    overlapped each other but nothing else: 1.5x the time of float32 rows stepped where they lie, at 10M rows
    (docs/benchmarks.md, Compact rows)."""
    width = values.shape[1]
    packed = (dim + 1) // 2
    state = width - packed
    words = np.empty((_BLOCK, width), np.float32)
    gbuf = np.empty((_BLOCK, dim), np.float32)
    kbuf = np.empty(_BLOCK, np.uint64)
    at = np.empty((2, _BLOCK), np.int64)
    src = np.empty((2, _BLOCK), np.int64)
    scratch = np.empty(dim + state, np.float32)
    scratch_bits = scratch.view(np.uint32)
    draws = np.empty((dim + 3) // 4, np.uint64)
    random16 = draws.view(np.uint16)  # 16 random bits a weight: four from each 64-bit draw (little-endian)
    applied = 0
    cur = 0
    k, j = _next_block(slots, perm, lo, hi, at[0], src[0])
    while k > 0:
        nxt = 1 - cur
        k_next, j = _next_block(slots, perm, j, hi, at[nxt], src[nxt])
        for q in range(k_next):  # requested now, used once this block is stepped
            prefetch(values, at[nxt, q], 0)
            prefetch(values, at[nxt, q], width - 1)
            prefetch(grads, src[nxt, q], 0)
        for q in range(k):  # gather
            r = src[cur, q]
            kbuf[q] = ids[r]
            for d in range(dim):
                gbuf[q, d] = grads[r, d]
            s = at[cur, q]
            for d in range(width):
                words[q, d] = values[s, d]
        for q in range(k):  # step
            row = words[q]
            halves = row.view(np.uint16)
            decode_row16(halves, scratch_bits, dim, storage)
            for d in range(state):
                scratch[dim + d] = row[packed + d]
            _apply_row(scratch, gbuf[q], dim, sgd, adagrad, adam, ftrl, rowwise, bounded)
            base = mix64(kbuf[q] ^ round_key)
            for i in range(draws.size):
                draws[i] = mix64(base + np.uint64(4 * i))
            encode_row16(scratch_bits, scratch, random16, halves, dim, storage)
            for d in range(state):
                row[packed + d] = scratch[dim + d]
        for q in range(k):  # scatter
            s = at[cur, q]
            for d in range(width):
                values[s, d] = words[q, d]
        applied += k
        cur = nxt
        k = k_next
    return applied


def optimizer_code(opt: EmbeddingOptimizerConfig) -> int:
    """The code of `opt`, recorded in the store header (and the place of its `kernel_rule`)."""
    return OPTIMIZER_CODES[opt.name]


def kernel_rule(opt: EmbeddingOptimizerConfig, hp: np.ndarray) -> tuple[object, ...]:
    """`apply_stripe`'s optimizer arguments (sgd, adagrad, adam, ftrl, rowwise, bounded): `hp` in the place of
    `opt`'s code, None in the others', and whether `hp` bounds the weights. A kernel compiles the optimizer
    whose argument is not None, and only that one (`_apply_row`)."""
    rule: list[object] = [None] * len(OPTIMIZER_CODES)
    rule[optimizer_code(opt)] = hp
    return (*rule, not bool(np.isnan(hp[HP_BOUND])))


def state_width(opt: EmbeddingOptimizerConfig, dim: int) -> int:
    """float32 values of optimizer state stored after a row's `dim` weights."""
    return {EmbeddingOptimizer.SGD: 0, EmbeddingOptimizer.ADAGRAD: dim, EmbeddingOptimizer.ADAM: 2 * dim + 1,
            EmbeddingOptimizer.FTRL: 2 * dim, EmbeddingOptimizer.ROWWISE_ADAGRAD: 1}[opt.name]


def accumulator_width(opt: EmbeddingOptimizerConfig, dim: int) -> int:
    """How many state values of a new row start at initial_accumulator_value (the rest start at 0)."""
    if opt.name == EmbeddingOptimizer.ROWWISE_ADAGRAD:
        return 1
    return dim if opt.name in (EmbeddingOptimizer.ADAGRAD, EmbeddingOptimizer.FTRL) else 0


def hyper_parameters(opt: EmbeddingOptimizerConfig, weight_bound: float | None) -> np.ndarray:
    """The float64 vector the update kernel reads (indices `HP_*`); NaN bound = none."""
    hp = np.zeros(NUM_HP, np.float64)
    hp[HP_LR] = opt.lr
    hp[HP_EPS] = opt.eps
    hp[HP_BETA1] = opt.beta1
    hp[HP_BETA2] = opt.beta2
    hp[HP_ADAM_EPS] = opt.adam_eps
    hp[HP_WD] = opt.weight_decay
    hp[HP_LR_POWER] = opt.lr_power
    hp[HP_L1] = opt.l1
    hp[HP_L2] = opt.l2
    hp[HP_BOUND] = np.nan if weight_bound is None else weight_bound
    return hp
