"""How a store row's weights are stored: float32, or 16-bit floats updated with stochastic rounding.

On the embedding PS. A row of a store is `row_width` float32 words (store_files.StoreConfig.row_width):
the weights first, then the optimizer's state, always float32. With `ps.storage: fp32` the weights are
`dim` words, as they always were. With `fp16` (IEEE half: 10 mantissa bits) or `bf16` (bfloat16: 7) two
weights share a word, so `dim` weights take ceil(dim / 2) words: at width 16 with row-wise Adagrad a row is
9 words (36 bytes) instead of 32 with float32 Adagrad.

Every file, copy, dump, replica and tier record moves a row as its words, whatever they hold; only the code
that reads or writes weights asks this module: the lookup kernels decode weights to float32 (the wire and the
NN workers see float32 as before), the optimizer decodes, updates in float32 and writes back with stochastic
rounding (`encode`: rounded up with probability equal to the distance from the lower neighbour, so the stored
weight is unbiased and small updates are not lost to rounding), and a new row's initial weights are rounded to
nearest. The rounding's random bits come from the row's key, the store's update count and the seed, so a run
reproduces.

The numba functions here are inlined into kernels.py and optimizers.py. numba's on-disk cache checks only the
file of the function it compiled: after editing this module, touch those two files (or clear the cache), or
their cached machine code keeps the old conversions.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridrec.core.config import WeightStorage

FP32, FP16, BF16 = 0, 1, 2
"""Storage codes the kernels take and the store header records (0, what stores made before had: float32)."""


STORAGE_CODES = {WeightStorage.FP32: FP32, WeightStorage.FP16: FP16, WeightStorage.BF16: BF16}
"""The kernels' code of each `ps.storage`."""
STORAGE_NAMES = {FP32: "fp32", FP16: "fp16", BF16: "bf16"}
"""The name of each storage code, for messages about a store's header."""

# Per 16-bit format: mantissa bits, exponent bias, largest finite bit pattern.
_MANT = (0, 10, 7)
_BIAS = (0, 15, 127)
_MAX_BITS = (0, 0x7BFF, 0x7F7F)


def kernel_storage(storage: int) -> int | None:
    """The `storage` argument the store's kernels take: None for float32 weights, FP16 or BF16 as they are.

    The kernels test `storage is None` rather than `storage == FP32`: numba drops a branch whose test is a
    comparison of an argument of type None with None before it compiles the function, so a float32 store's
    kernels are compiled without any of this module's 16-bit code (whereas a branch on an integer's value is
    compiled whatever the value). That code was most of a PS's cold start: 34.3 s to compile its kernels
    with it, 9.1 s without (docs/architecture.md, Start-up). A 16-bit store's kernels are compiled for an integer
    `storage`, as one more signature of each kernel."""
    return None if storage == FP32 else storage


def weight_words(dim: int, storage: int) -> int:
    """float32 words a row's `dim` weights take."""
    return dim if storage == FP32 else (dim + 1) // 2


def _scales(storage: int) -> np.ndarray:
    """Per exponent field: the value of one unit of the significand (index 0: subnormals, as exponent 1)."""
    mant, bias = _MANT[storage], _BIAS[storage]
    top = 1 << (15 - mant)
    return np.array([math.ldexp(1.0, max(e, 1) - bias - mant) for e in range(top)], np.float64)


_FP16_SCALES = _scales(FP16)
_BF16_SCALES = _scales(BF16)


@njit(inline="always", error_model="numpy")
def decode16(h, storage):
    """The float32 value of 16-bit pattern `h` (uint16) of `storage` (FP16 or BF16)."""
    mant = 10 if storage == FP16 else 7
    e = (np.int64(h) >> mant) & ((1 << (15 - mant)) - 1)
    m = np.int64(h) & ((1 << mant) - 1)
    if e == (1 << (15 - mant)) - 1:  # inf / NaN: never written by encode16, kept readable
        v = np.inf if m == 0 else np.nan
    else:
        scale = _FP16_SCALES[e] if storage == FP16 else _BF16_SCALES[e]
        v = np.float64(m + (np.int64(1) << mant if e > 0 else 0)) * scale
    return np.float32(-v if np.int64(h) & 0x8000 else v)


@njit(inline="always", error_model="numpy")
def encode16(x, u, storage):
    """`x` (float32) as a 16-bit pattern of `storage`, rounded down or up at random: up with probability
    equal to its distance from the lower neighbour, in ulps, for `u` uniform in [0, 1) (u = 0.5: to nearest).
    Magnitudes past the largest finite value saturate to it; NaN stays NaN."""
    mant = 10 if storage == FP16 else 7
    bias = 15 if storage == FP16 else 127
    top = (1 << (15 - mant)) - 1
    if x != x:
        return np.uint16(0x7E00 if storage == FP16 else 0x7FC0)
    sign = 0x8000 if x < 0 else 0
    a = abs(np.float64(x))
    if a == 0.0:
        return np.uint16(sign)
    e = math.frexp(a)[1] + bias - 1  # the exponent field of a normal number in [2**(e-bias), 2**(e-bias+1))
    if e < 1:
        e = 0
    scale = _FP16_SCALES[e] if storage == FP16 else _BF16_SCALES[e]
    k = np.int64(math.floor(a / scale + u))  # exact: a has 24 significant bits, u 24, in float64
    bits = (np.int64(e) << mant) + k - (np.int64(1) << mant) if e > 0 else k  # a carry moves to the exponent
    if e >= top or bits > (_MAX_BITS[1] if storage == FP16 else _MAX_BITS[2]):
        bits = _MAX_BITS[1] if storage == FP16 else _MAX_BITS[2]
    return np.uint16(bits | sign)


@njit(inline="always", error_model="numpy")
def decode16_bits(h, storage):
    """The float32 bit pattern (uint32) of 16-bit pattern `h` of `storage`: the update's decoding, bit
    operations only (fp16 subnormals, rare in a trained table, through `decode16`)."""
    h32 = np.uint32(h)
    if storage != FP16:
        return h32 << np.uint32(16)
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    e = (h32 >> np.uint32(10)) & np.uint32(31)
    if e == 0 or e == 31:
        return _float_bits_slow(decode16(h, storage))
    return sign | (((h32 & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(112 << 23))


@njit(inline="always", error_model="numpy")
def _float_bits_slow(x):
    """The bit pattern of float32 x, through a one-element array (numba has no scalar bit cast)."""
    box = np.empty(1, np.float32)
    box[0] = x
    return box.view(np.uint32)[0]


@njit(inline="always", error_model="numpy")
def encode16_bits(bits, x, random16, storage):
    """float32 `x` (its bit pattern `bits`) as a 16-bit pattern of `storage`, rounded at random with 16 random
    bits: the bits float32 has past the format's mantissa get `random16`'s low ones added before they are
    dropped, which rounds up with probability exactly their value, in ulps (13 bits for fp16, 16 for bf16).
    fp16's subnormal range and overflow go through `encode16` (saturating)."""
    magnitude = bits & np.uint32(0x7FFFFFFF)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    if storage != FP16:
        if magnitude >= np.uint32(0x7F800000):  # inf / NaN: encode16 saturates or keeps NaN
            return encode16(x, 0.5, storage)
        rounded = (magnitude + (np.uint32(random16) & np.uint32(0xFFFF))) >> np.uint32(16)
        return np.uint16(sign | (rounded if rounded < np.uint32(0x7F80) else np.uint32(0x7F7F)))
    e = magnitude >> np.uint32(23)
    if e < np.uint32(113) or e > np.uint32(142):  # below fp16's normals, or past its range
        return encode16(x, np.float64(np.uint32(random16) & np.uint32(0xFFFF)) * (1.0 / 65536.0), storage)
    rounded = ((magnitude + (np.uint32(random16) & np.uint32(0x1FFF))) >> np.uint32(13)) - np.uint32(112 << 10)
    return np.uint16(sign | (rounded if rounded <= np.uint32(0x7BFF) else np.uint32(0x7BFF)))


@njit(inline="always", error_model="numpy")
def decode_row16(halves, bits, dim, storage):
    """bits[:dim] = the float32 bit patterns of 16-bit weights halves[:dim]. One pass without branches (which
    LLVM vectorises) when every weight is an fp16 normal, as a trained row's are; element by element through
    `decode16_bits` when one is not (zero, subnormal, inf/NaN): the same patterns either way."""
    if storage != FP16:
        for d in range(dim):
            bits[d] = np.uint32(halves[d]) << np.uint32(16)
        return
    odd = np.uint32(0)
    for d in range(dim):
        h = np.uint32(halves[d])
        e = (h >> np.uint32(10)) & np.uint32(31)
        odd |= np.uint32(e - np.uint32(1) >= np.uint32(30))  # e == 0 wraps past 30
        bits[d] = ((h & np.uint32(0x8000)) << np.uint32(16)) | (((h & np.uint32(0x7FFF)) << np.uint32(13))
                                                                 + np.uint32(112 << 23))
    if odd:
        for d in range(dim):
            bits[d] = decode16_bits(halves[d], storage)


@njit(inline="always", error_model="numpy")
def encode_row16(bits, x, random16, halves, dim, storage):
    """halves[:dim] = float32 weights x[:dim] (their bit patterns `bits`) rounded at random to 16 bits with
    random16[:dim]: `encode16_bits` for each, in one branch-free pass when every weight is within the format's
    normal range (the common case), element by element when one is not: the same patterns either way."""
    odd = np.uint32(0)
    if storage == FP16:
        for d in range(dim):
            magnitude = bits[d] & np.uint32(0x7FFFFFFF)
            odd |= np.uint32((magnitude >> np.uint32(23)) - np.uint32(113) > np.uint32(29))  # e < 113 wraps
            rounded = ((magnitude + (np.uint32(random16[d]) & np.uint32(0x1FFF))) >> np.uint32(13)) \
                - np.uint32(112 << 10)
            halves[d] = np.uint16(((bits[d] >> np.uint32(16)) & np.uint32(0x8000)) | min(rounded, np.uint32(0x7BFF)))
    else:
        for d in range(dim):
            magnitude = bits[d] & np.uint32(0x7FFFFFFF)
            odd |= np.uint32(magnitude >= np.uint32(0x7F800000))
            rounded = (magnitude + np.uint32(random16[d])) >> np.uint32(16)
            halves[d] = np.uint16(((bits[d] >> np.uint32(16)) & np.uint32(0x8000)) | min(rounded, np.uint32(0x7F7F)))
    if odd:
        for d in range(dim):
            halves[d] = encode16_bits(bits[d], x[d], random16[d], storage)


def _prefetch_codegen(context, builder, signature, args):
    """LLVM's `llvm.prefetch` of the element args[1:] of array args[0]: read, kept in every cache level."""
    array_type = signature.args[0]
    view = context.make_array(array_type)(context, builder, args[0])
    pointer = cgutils.get_item_pointer(context, builder, array_type, view, list(args[1:]))
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(pointer, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
    return context.get_dummy_value()


@intrinsic
def prefetch(typingctx, array, row, column):
    """Ask the memory for the cache line of array[row, column] (2-D) without waiting for it: numba has no way
    to say it, and a load would wait. The kernels use it a few rows ahead where the loop between a row's
    address and its use is too long for the CPU to overlap many rows' cache misses on its own."""
    return types.void(array, row, column), _prefetch_codegen


@intrinsic
def prefetch1(typingctx, array, index):
    """`prefetch` of array[index] (1-D)."""
    return types.void(array, index), _prefetch_codegen


@njit(inline="always", error_model="numpy")
def mix64(z):
    """splitmix64's finalizer: the rounding's random bits from (key, update count, position)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


# ---------------------------------------------------------------- numpy: checkpoints, export, peek
def decode_weights(rows: np.ndarray, dim: int, storage: int) -> np.ndarray:
    """The float32 weights (n, dim) of rows (n, row_width float32 words) of a store of `storage`."""
    if storage == FP32:
        return rows[:, :dim]
    halves = np.ascontiguousarray(rows[:, :weight_words(dim, storage)]).view(np.uint16)[:, :dim]
    if storage == FP16:
        return halves.view(np.float16).astype(np.float32)
    return (halves.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_weights(weights: np.ndarray, storage: int) -> np.ndarray:
    """Weights (n, dim) float32 as the (n, weight_words) words of `storage`, rounded to nearest (even);
    magnitudes past the format's largest finite value saturate to it."""
    n, dim = weights.shape
    if storage == FP32:
        return np.ascontiguousarray(weights, np.float32)
    halves = np.zeros((n, 2 * weight_words(dim, storage)), np.uint16)
    w = np.asarray(weights, np.float32)
    if storage == FP16:
        big = float(np.finfo(np.float16).max)
        halves[:, :dim] = np.clip(w, -big, big).astype(np.float16).view(np.uint16)
    else:
        bits = w.view(np.uint32).astype(np.uint64)
        nearest = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        finite = np.isfinite(w)
        limit = np.where(np.signbit(w), 0xFF7F, 0x7F7F).astype(np.uint64)
        rounded = np.where(finite & ((nearest & 0x7F80) != 0x7F80), nearest, np.where(finite, limit, bits >> 16))
        halves[:, :dim] = rounded.astype(np.uint16)
    return halves.view(np.float32)
