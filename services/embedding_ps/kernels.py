"""Numba kernels of the embedding store (run inside the embedding PS process).

Every `*_stripe` kernel works on ONE stripe: it receives that stripe's own
views of the shared arrays (index region, keys, prev/next, values, header row)
and uses stripe-local slot numbers, so it needs no offsets and cannot touch
another stripe. The caller holds only that stripe's lock; `nogil=True` lets two
request threads run kernels of two stripes on two cores at once.

Kernels use error_model="numpy" (a float division by zero gives inf, as in
numpy, instead of raising): the Python error model's zero checks keep LLVM
from vectorising loops.

The index, LRU and row code shares this one module; the optimizer arithmetic
(optimizers.py) calls nothing from here, and both call row_storage.py, the one
place that knows how 16-bit weights are stored. numba's own on-disk cache
checks only the source file of the function it compiled; the project's
(`hybridrec.core.runtime.kernel_cache`) is keyed by every kernel file, so an edit to any of
them compiles every kernel again, never running stale inlined code.

Crash safety relies on the order of writes when a slot changes owner
(see `_take_slot` / `insert_misses`): a slot's key is cleared before its row is
rewritten and set only once the row is complete, so a stripe rebuilt from
`keys` after a crash never pairs a key with a half-written row.
"""
from __future__ import annotations

import math

import numpy as np
from numba import types

from hybridrec.core.runtime.kernel_cache import njit
from services.embedding_ps.row_storage import decode_row16, encode16, prefetch, prefetch1

EMPTY_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)
"""`keys` value of a free slot; this one ID can therefore never be stored."""
EMPTY = -1
"""Index entry that holds no slot; a probe stops there."""
# A used index entry is an int32 (tag << SLOT_BITS) | slot: the tag, 7 bits of the key's hash that the
# bucket does not use, lets a probe skip other keys' entries (stale ones included) without loading
# their key. Hence at most 2**24 slots per stripe (checked by StoreConfig).
SLOT_BITS = 24
SLOT_MASK = (1 << SLOT_BITS) - 1
MAX_STRIPE_ROWS = 1 << SLOT_BITS
_TAG_SHIFT = np.uint64(25)  # buckets use hash bits below 25 (index regions are at most 2**25 entries)

# Per-stripe header row (int64). Changing it means bumping LAYOUT_VERSION in store_files.py.
F_DIRTY = 0          # 1 while a kernel may be mutating the stripe
F_USED = 1           # live rows; they occupy local slots [0, used)
F_HEAD = 2           # most recently used slot (-1: empty list)
F_TAIL = 3           # least recently used slot, evicted next
F_EVICTIONS = 4
F_ADMISSION_DROPS = 5  # train lookups of new IDs that were not admitted
F_ADMIT_DRAWS = 6    # counter feeding the admission random draws
F_MISSING_UPDATES = 7  # update() rows whose ID was not in the store
F_INSERTS = 8
F_READ_MISSES = 9    # train=False lookups of absent IDs
F_REBUILDS = 10      # times the stripe was rebuilt after a crash
F_STALE = 11         # index entries left by evictions, not yet swept (an upper bound)
F_SKETCH_ADDS = 12   # occurrences counted in the stripe's sketch since its last halving
F_SKETCH_HALVINGS = 13  # times the stripe's sketch counters were halved
F_ROUNDS = 14        # updates applied to the stripe: a 16-bit store's rounding draws differ from one to the next
STRIPE_FIELDS = 16

# Per-table counters (tables.bin: int64 [stripe, feature group, field]).
T_ADMITTED = 0       # rows created for the table's IDs
T_REJECTED = 1       # training lookups of an ID without a row that did not admit it (count or probability)
T_EXPIRED = 2        # rows removed because they were not updated within the table's TTL
T_DROPPED = 3        # gradients of IDs without a row (not admitted, expired or evicted), dropped by update()
TABLE_FIELDS = 4
NUM_TABLES = 256     # one per feature group (hybridrec.core.wire.ids.MAX_GROUPS)
_GROUP_SHIFT = np.uint64(56)  # hybridrec.core.wire.ids.GROUP_SHIFT
_U32_MASK = np.uint64(0xFFFFFFFF)

_U11, _U32, _U33 = np.uint64(11), np.uint64(32), np.uint64(33)
_FM1 = np.uint64(0xFF51AFD7ED558CCD)
_FM2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Salt of the index/stripe hash. The shard of an ID is splitmix64(id) % N; a
# different mixer (murmur3 fmix64) of a salted ID keeps a shard's IDs spread
# over all of its stripes and buckets.
_INDEX_SALT = np.uint64(0x2545F4914F6CDD1D)
_INV_2_53 = 1.0 / 9007199254740992.0


@njit(inline="always", error_model="numpy")
def fmix64(x):
    """murmur3 64-bit finaliser: a cheap bijective mixer (uint64 -> uint64)."""
    x ^= x >> _U33
    x *= _FM1
    x ^= x >> _U33
    x *= _FM2
    x ^= x >> _U33
    return x


@njit(inline="always", error_model="numpy")
def key_hash(key):
    return fmix64(key ^ _INDEX_SALT)


@njit(inline="always", error_model="numpy")
def stripe_of_hash(h, num_stripes):
    """Stripe from the high 32 bits (multiply-shift, no division); buckets use the low bits."""
    return np.int64(((h >> _U32) * np.uint64(num_stripes)) >> _U32)


@njit(nogil=True, cache=True, error_model="numpy")
def mix_seed(seed, salt):
    """Per-table key of a seed, shared by the store and `init_rows`."""
    return fmix64(np.uint64(seed) ^ fmix64(np.uint64(salt)))


@njit(nogil=True, cache=True, error_model="numpy")
def partition(ids, num_stripes, perm):
    """Counting sort of positions by stripe: perm[off[s]:off[s+1]] are stripe s's ids, in order."""
    counts = np.zeros(num_stripes + 1, np.int64)
    for i in range(ids.shape[0]):
        counts[stripe_of_hash(key_hash(ids[i]), num_stripes) + 1] += 1
    for s in range(num_stripes):
        counts[s + 1] += counts[s]
    pos = counts[:-1].copy()
    for i in range(ids.shape[0]):
        s = stripe_of_hash(key_hash(ids[i]), num_stripes)
        perm[pos[s]] = i
        pos[s] += 1
    return counts


# ---------------------------------------------------------------- hash index
@njit(inline="always", error_model="numpy")
def _entry(h, s):
    """Index entry of slot s for a key of hash h."""
    return np.int32((np.int64((h >> _TAG_SHIFT) & np.uint64(0x7F)) << SLOT_BITS) | s)


@njit(inline="always", error_model="numpy")
def _find(index, keys, key, h):
    """Linear probing: (slot, position) of `key`, or (-1, first empty position).

    An entry counts only if its tag matches and its slot holds `key` now, so
    the stale entries that evictions leave behind (see `_take_slot`) are
    stepped over like any other key's, and can never return a wrong row.
    """
    mask = index.shape[0] - 1
    b = np.int64(h & np.uint64(mask))
    tag = np.int32(np.int64((h >> _TAG_SHIFT) & np.uint64(0x7F)))
    while True:
        e = index[b]
        if e < 0:
            return -1, b
        if (e >> SLOT_BITS) == tag and keys[e & SLOT_MASK] == key:
            return e & SLOT_MASK, b
        b = (b + 1) & mask


@njit(nogil=True, cache=True, error_model="numpy")
def _reindex(index, keys, hdr):
    """Rebuild the index from slots [0, used), dropping every stale entry.

    Evictions do not delete index entries: a deletion is a random write (or,
    with backward shift, several random reads) per evicted row, which made
    streaming new IDs 30% slower than filling free slots. The stale entries
    are swept here once there may be a quarter of the index of them, so
    probes stay short; one stripe's index region stays in cache while this runs.
    """
    mask = index.shape[0] - 1
    index[:] = EMPTY
    for s in range(hdr[F_USED]):
        if keys[s] == EMPTY_KEY:  # a slot being rewritten (only rebuild_stripe's input has these)
            continue
        h = key_hash(keys[s])
        b = np.int64(h & np.uint64(mask))
        while index[b] != EMPTY:
            b = (b + 1) & mask
        index[b] = _entry(h, s)
    hdr[F_STALE] = 0


@njit(inline="always", error_model="numpy")
def _sweep_stale(index, keys, hdr):
    """Reindex once stale entries may exceed a quarter of the index; True if it did.

    With at most half the index live (see store_files.Layout), that keeps live +
    stale entries below 3/4 of it, so probes are short and always end.
    """
    if hdr[F_STALE] > index.shape[0] // 4:
        _reindex(index, keys, hdr)
        return True
    return False


@njit(inline="always", error_model="numpy")
def _home_entries(ids, perm, lo, hi, slots, index):
    """slots[j] = the entry in the home bucket of ids[perm[j]]: one pass of independent loads."""
    mask = np.uint64(index.shape[0] - 1)
    for j in range(lo, hi):
        slots[j] = index[np.int64(key_hash(ids[perm[j]]) & mask)]


@njit(inline="always", error_model="numpy")
def _resolve(ids, perm, lo, hi, slots, index, keys):
    """slots[j] = slot of ids[perm[j]] or -1, for j in [lo, hi).

    Two independent passes rather than one probe loop: the first loads every
    ID's home bucket, the second checks the key there (a full probe only when
    it is not the one). Each pass's loads do not depend on each other, so the
    CPU keeps many cache/TLB misses in flight (measured 1.4x faster than
    probing ID by ID; explicit software prefetch was slower here, in this loop:
    the 16-bit rows' lookup and update do ask ahead, `resolve_and_decode` and
    optimizers._apply_compact, where decoding stands between a row's address
    and its use).
    """
    _home_entries(ids, perm, lo, hi, slots, index)
    for j in range(lo, hi):
        slots[j] = _slot_from_home(slots[j], ids[perm[j]], index, keys)


@njit(inline="always", error_model="numpy")
def _slot_from_home(e, key, index, keys):
    """The slot of `key` or -1, given the entry `e` of its home bucket: that entry's slot when it holds the
    key, else a full probe."""
    h = key_hash(key)
    if e >= 0 and e == _entry(h, e & SLOT_MASK) and keys[e & SLOT_MASK] == key:
        return e & SLOT_MASK
    return _find(index, keys, key, h)[0]


@njit(inline="always", error_model="numpy")
def _resolve_and_copy(ids, perm, lo, hi, slots, out, index, keys, values, storage):
    """`_resolve`, then copy each found row into out[perm[j]], in two passes instead of three.

    The second pass copies the row its home entry points to while it checks
    that slot's key, so the key's cache miss overlaps the row's instead of
    having a pass of its own; a wrong guess (another key there, or a probe
    needed) is then resolved by a full probe and copied again. 16-bit rows
    are resolved and decoded in one pass that asks for rows ahead instead
    (`resolve_and_decode`).
    """
    dim = out.shape[1]
    if storage is None:
        _resolve_and_copy_rows(ids, perm, lo, hi, slots, out, index, keys, values, dim)
    else:
        resolve_and_decode(ids, perm, lo, hi, slots, out, index, keys, values, storage)


@njit(nogil=True, cache=True, error_model="numpy")
def resolve_and_decode(ids, perm, lo, hi, slots, out, index, keys, values, storage):
    """`_resolve_and_copy` of 16-bit rows: each resolved and decoded into `out` where it lies, its key and row
    asked for _AHEAD IDs early. A kernel of its own, called rather than inlined, so that a float32 store's
    lookup (`storage` None) is compiled without it (row_storage.kernel_storage)."""
    dim = out.shape[1]
    _home_entries(ids, perm, lo, hi, slots, index)
    width = values.shape[1]
    for j in range(lo, min(lo + _AHEAD, hi)):
        _prefetch_home(slots[j], keys, values, width)
    for j in range(lo, hi):
        if j + _AHEAD < hi:
            _prefetch_home(slots[j + _AHEAD], keys, values, width)
        s = _slot_from_home(slots[j], ids[perm[j]], index, keys)
        slots[j] = s
        if s >= 0:
            decode_row16(values[s].view(np.uint16), out[perm[j]].view(np.uint32), dim, storage)


_AHEAD = 12
"""How many IDs ahead a 16-bit lookup asks for the row and key its home entry points to."""


@njit(inline="always", error_model="numpy")
def _prefetch_home(e, keys, values, width):
    """Ask for the key and the row (both its lines, where it straddles two) that home entry `e` points to."""
    if e >= 0:
        s = e & SLOT_MASK
        prefetch1(keys, s)
        prefetch(values, s, 0)
        prefetch(values, s, width - 1)


@njit(inline="always", error_model="numpy")
def _resolve_and_copy_rows(ids, perm, lo, hi, slots, out, index, keys, values, width):
    """`_resolve_and_copy`'s loop for float32 rows: out[perm[j], :width] = values[slot of ids[perm[j]], :width]."""
    _home_entries(ids, perm, lo, hi, slots, index)
    for j in range(lo, hi):
        e = slots[j]
        key = ids[perm[j]]
        h = key_hash(key)
        if e >= 0 and e == _entry(h, e & SLOT_MASK):
            s = e & SLOT_MASK
            _copy_row(out, perm[j], values, s, width)
            if keys[s] == key:
                slots[j] = s
                continue
        s = _find(index, keys, key, h)[0]
        slots[j] = s
        if s >= 0:
            _copy_row(out, perm[j], values, s, width)


# ---------------------------------------------------------------- LRU list
@njit(inline="always", error_model="numpy")
def _unlink(prev, nxt, hdr, s):
    p = prev[s]
    n = nxt[s]
    if p >= 0:
        nxt[p] = n
    else:
        hdr[F_HEAD] = n
    if n >= 0:
        prev[n] = p
    else:
        hdr[F_TAIL] = p


@njit(inline="always", error_model="numpy")
def _push_head(prev, nxt, hdr, s):
    head = hdr[F_HEAD]
    prev[s] = -1
    nxt[s] = head
    if head >= 0:
        prev[head] = s
    else:
        hdr[F_TAIL] = s
    hdr[F_HEAD] = s


@njit(inline="always", error_model="numpy")
def _touch(prev, nxt, hdr, s):
    if hdr[F_HEAD] != s:
        _unlink(prev, nxt, hdr, s)
        _push_head(prev, nxt, hdr, s)


# ---------------------------------------------------------------- rows
@njit(inline="always", error_model="numpy")
def _copy_row(dst, i, src, s, n):
    """dst[i, :n] = src[s, :n] as an explicit loop: numba's slice assignment is ~10x slower here."""
    for d in range(n):
        dst[i, d] = src[s, d]


@njit(inline="always", error_model="numpy")
def _copy_weights(dst, i, src, s, dim, storage):
    """dst[i, :dim] = the float32 weights of row src[s], decoded from 16 bits unless `storage` is None."""
    if storage is None:
        _copy_row(dst, i, src, s, dim)
    else:
        decode_row(dst, i, src, s, dim, storage)


@njit(nogil=True, cache=True, error_model="numpy")
def decode_row(dst, i, src, s, dim, storage):
    """dst[i, :dim] = the float32 weights of 16-bit row src[s]: `_copy_weights`' call, not inlined, so that a
    float32 store's kernels never compile it (row_storage.kernel_storage)."""
    decode_row16(src[s].view(np.uint16), dst[i].view(np.uint32), dim, storage)


@njit(inline="always", error_model="numpy")
def _zero_row(dst, i):
    for d in range(dst.shape[1]):
        dst[i, d] = 0.0


@njit(inline="always", error_model="numpy")
def _init_weight(row, halves, d, value, storage):
    """Weight d of a new row: float32, or its 16-bit pattern rounded to nearest (deterministic)."""
    if storage is None:
        row[d] = np.float32(value)
    else:
        halves[d] = encode_nearest(value, storage)


@njit(nogil=True, cache=True, error_model="numpy")
def encode_nearest(value, storage):
    """`value` as a 16-bit pattern of `storage`, rounded to nearest: `_init_weight`'s call, not inlined, so
    that a float32 store's kernels never compile it (row_storage.kernel_storage); a new row's weights only."""
    return encode16(np.float32(value), 0.5, storage)


@njit(nogil=True, cache=True, error_model="numpy")
def init_row(values, s, key, dim, init_key, normal, scale, init_acc, acc_width, storage):
    """Deterministic initial embedding of row `s` from (seed, id), then the optimizer's initial state:
    `acc_width` values of `init_acc` (Adagrad's sum, FTRL's accumulator), zeros after them. Weights of a
    16-bit `storage` take (dim + 1) // 2 words, the last half of an odd width zero.

    A kernel of its own, called once a new row (a call is nothing beside its hashing and, normal, its
    logarithms): inlined at its three places it was compiled three times, a second of a cold start."""
    row = values[s]
    halves = row.view(np.uint16)
    packed = dim if storage is None else (dim + 1) // 2
    if storage is not None:
        row[packed - 1] = 0.0
    base = fmix64(key ^ init_key)
    if normal:
        for d in range(0, dim, 2):  # Box-Muller: one (log, sqrt) per pair of values
            z1 = fmix64(base + np.uint64(d + 1) * _GOLDEN)
            z2 = fmix64(base + np.uint64(d + 2) * _GOLDEN)
            u1 = (np.float64(z1 >> _U11) + 1.0) * _INV_2_53  # (0, 1]: log is finite
            u2 = np.float64(z2 >> _U11) * _INV_2_53
            r = math.sqrt(-2.0 * math.log(u1)) * scale
            _init_weight(row, halves, d, r * math.cos(2.0 * math.pi * u2), storage)
            if d + 1 < dim:
                _init_weight(row, halves, d + 1, r * math.sin(2.0 * math.pi * u2), storage)
    else:
        for d in range(dim):
            u = np.float64(fmix64(base + np.uint64(d + 1) * _GOLDEN) >> _U11) * _INV_2_53
            _init_weight(row, halves, d, (2.0 * u - 1.0) * scale, storage)
    acc = np.float32(init_acc)
    for d in range(packed, packed + acc_width):
        row[d] = acc
    for d in range(packed + acc_width, values.shape[1]):
        row[d] = 0.0


@njit(nogil=True, cache=True, error_model="numpy")
def init_rows_kernel(ids, out, dim, init_key, normal, scale, storage):
    """The initial weights (no optimizer state) of `ids` as a store of `storage` holds them: `init_rows`."""
    for i in range(ids.shape[0]):
        init_row(out, i, ids[i], dim, init_key, normal, scale, 0.0, 0, storage)


@njit(inline="always", error_model="numpy")
def _take_slot(keys, prev, nxt, hdr):
    """A free slot, or the LRU tail after unlinking it; its index entry goes stale.

    The key is cleared before the caller rewrites the row (crash ordering)."""
    used = hdr[F_USED]
    if used < keys.shape[0]:
        hdr[F_USED] = used + 1
        return used
    s = hdr[F_TAIL]
    _unlink(prev, nxt, hdr, s)
    hdr[F_STALE] += 1
    keys[s] = EMPTY_KEY
    hdr[F_EVICTIONS] += 1
    return s


@njit(inline="always", error_model="numpy")
def _insert(index, keys, prev, nxt, hdr, key, s):
    """Publish a fully written row: key, then index entry, then LRU head.

    The probe may meet a stale entry that already points to s (s held
    another key before): it then becomes s's entry again."""
    keys[s] = key
    h = key_hash(key)
    index[_find(index, keys, key, h)[1]] = _entry(h, s)
    _push_head(prev, nxt, hdr, s)
    hdr[F_INSERTS] += 1


# ---------------------------------------------------------------- disk tier
# A stripe's region of the disk tier (services/embedding_ps/tier.py) comes as one tuple `tier`:
# (tkeys (pages, 512) uint64, tvals (pages, 1024) float32: two read-only views of the same 4 KiB pages; thdr:
# the stripe's counters (TF_*); tmarks: one uint8 per record, 1 when it changed since a checkpoint copied it;
# per_page: records per page; fd: the file, written with pwrite; first: the region's first page in the file;
# scratch: one uint64, a key on its way to pwrite). A page holds its records' keys first, stored as key + 1 so
# that the zeros of a new sparse file read as empty, then their rows: record r's row is
# tvals[p, 2 * per_page + r * width:...]. Writes go through pwrite, never through the mapping: the kernel
# write-protects a mapped page each time it writes it back, and in a VM the TLB shootdown that takes cost a
# quarter of two cores under training (profiled); the page cache keeps reads and writes coherent.
# A key's home page is a hash of it; a full page sends it to the next (linear probing by page). Records are
# never deleted, so a probe ends at the first page with an empty record. A store without a tier passes None
# to the kernels that take one: their disk code sits under `tier is not None` tests, which numba decides when
# it compiles them, so such a store compiles none of it (row_storage.kernel_storage says how).
TF_ROWS = 0          # records in the stripe's region
TF_LIMIT = 1         # records the region may hold (ps.tier.capacity / num_stripes)
TF_FILLS = 2         # rows a training lookup read back from disk instead of initialising them
TF_WRITEBACKS = 3    # evicted rows written to disk
TF_OVERFLOWS = 4     # evicted rows lost because the region was full (ps.tier.capacity too small)
TF_DISK_UPDATES = 5  # gradients applied to rows on disk (evicted between their lookup and their update)
TF_DISK_READS = 6    # read-only lookups answered from disk
TF_LOOKUPS = 7       # IDs of training lookups
TF_MISSES = 8        # distinct IDs of training lookups not in memory (filled from disk or new)
TF_WRITE_ERRORS = 9  # pwrites that failed (an I/O error, a full disk): the store raises after the call
TIER_FIELDS = 16
PAGE_BYTES = 4096
POSIX_FADV_WILLNEED = 3
# libc by symbol name, so that the kernels calling them stay cacheable (a ctypes pointer is per process).
_pwrite = types.ExternalFunction("pwrite", types.int64(types.int32, types.uint64, types.uint64, types.int64))
_fadvise = types.ExternalFunction("posix_fadvise", types.int32(types.int32, types.int64, types.int64, types.int32))


@njit(inline="always", error_model="numpy")
def _tier_home(h, pages):
    """The home page of a key of hash h in a region of `pages` pages (hash bits the stripe and index do not use)."""
    return np.int64((h >> _U32) % np.uint64(pages))


@njit(inline="always", error_model="numpy")
def _tier_base(per_page, r, width):
    """Float offset of record r's row in its page: after the page's per_page keys (two floats each)."""
    return 2 * per_page + r * width


@njit(inline="always", error_model="numpy")
def _tier_write(tier, p, offset, address, nbytes):
    """pwrite nbytes at `address` to byte `offset` of region page p; False, counted, when it fails."""
    fd, first = tier[5], tier[6]
    at = (first + p) * PAGE_BYTES + offset
    if _pwrite(fd, np.uint64(address), np.uint64(nbytes), at) != nbytes:
        tier[2][TF_WRITE_ERRORS] += 1
        return False
    return True


@njit(inline="always", error_model="numpy")
def _tier_write_row(tier, p, r, src, s, width):
    """Record r of region page p gets row src[s] (`width` float32, C-contiguous)."""
    per_page = tier[4]
    return _tier_write(tier, p, _tier_base(per_page, r, width) * 4, src.ctypes.data + s * src.strides[0], width * 4)


@njit(inline="always", error_model="numpy")
def _tier_probe(tkeys, per_page, key, cur, buf):
    """(found, page, record) of `key` in a region; not found: where it would go ((-1, -1) when the region
    is full or has no pages). Page `cur` is read from `buf` instead of the file (a page being rewritten whole:
    `load_cold_stripe`); cur = -1 reads every page from the file."""
    pages = tkeys.shape[0]
    if pages == 0:
        return False, -1, -1
    stored = key + np.uint64(1)
    p = _tier_home(key_hash(key), pages)
    for _ in range(pages):
        for r in range(per_page):
            k = buf[r] if p == cur else tkeys[p, r]
            if k == stored:
                return True, p, r
            if k == 0:
                return False, p, r
        p += 1
        if p == pages:
            p = 0
    return False, -1, -1


@njit(inline="always", error_model="numpy")
def _tier_find(tkeys, per_page, key):
    """`_tier_probe` reading every page from the file."""
    return _tier_probe(tkeys, per_page, key, -1, tkeys[:, 0])


@njit(inline="always", error_model="numpy")
def _tier_get(tier, key, dst, i, n, width):
    """dst[i, :n] = the first n values of `key`'s row (`width` values) on disk; False when it has none."""
    tkeys, tvals, per_page = tier[0], tier[1], tier[4]
    found, p, r = _tier_find(tkeys, per_page, key)
    if not found:
        return False
    base = _tier_base(per_page, r, width)
    for d in range(n):
        dst[i, d] = tvals[p, base + d]
    return True


@njit(inline="always", error_model="numpy")
def _tier_put(tier, key, src, s, width):
    """Write row src[s] (`width` values) as `key`'s record on disk: the row before a new record's key (a crash
    leaves no key with a half-written row). False, counted, when the region is full; False, not counted, for
    a region of zero pages."""
    tkeys, thdr, tmarks, per_page, scratch = tier[0], tier[2], tier[3], tier[4], tier[7]
    if tkeys.shape[0] == 0:
        return False
    found, p, r = _tier_find(tkeys, per_page, key)
    if p < 0 or (not found and thdr[TF_ROWS] >= thdr[TF_LIMIT]):
        thdr[TF_OVERFLOWS] += 1
        return False
    if not _tier_write_row(tier, p, r, src, s, width):
        return False
    if not found:
        scratch[0] = key + np.uint64(1)
        if not _tier_write(tier, p, r * 8, scratch.ctypes.data, 8):
            return False
        thdr[TF_ROWS] += 1
    tmarks[p * per_page + r] = 1
    thdr[TF_WRITEBACKS] += 1
    return True


@njit(inline="always", error_model="numpy")
def _evict_slot(keys, prev, nxt, values, hdr, tier):
    """`_take_slot`, writing an evicted row to the disk tier first (before its key is cleared); `tier` None:
    the store has none."""
    if tier is not None and hdr[F_USED] == keys.shape[0]:
        victim = hdr[F_TAIL]
        _tier_put(tier, keys[victim], values, victim, values.shape[1])
    return _take_slot(keys, prev, nxt, hdr)


@njit(nogil=True, cache=True, error_model="numpy")
def advise_pages(ids, perm, lo, hi, slots, keys, prev, hdr, tier, victims):
    """Ask the kernel to read, in the background and all at once, the home pages of the IDs not in memory
    (slots[j] < 0) and, with `victims`, of as many rows at the LRU tail as those IDs could evict: the pages a
    lookup is about to read or write (posix_fadvise WILLNEED; tier.py says why). Returns how many."""
    pages = tier[0].shape[0]
    if pages == 0:
        return 0
    fd, first = tier[5], tier[6]
    n = 0
    for j in range(lo, hi):
        if slots[j] < 0:
            p = _tier_home(key_hash(ids[perm[j]]), pages)
            _fadvise(fd, (first + p) * PAGE_BYTES, PAGE_BYTES, POSIX_FADV_WILLNEED)
            n += 1
    if victims:
        evicting = n - (keys.shape[0] - hdr[F_USED])
        s = hdr[F_TAIL]
        while evicting > 0 and s >= 0:
            p = _tier_home(key_hash(keys[s]), pages)
            _fadvise(fd, (first + p) * PAGE_BYTES, PAGE_BYTES, POSIX_FADV_WILLNEED)
            n += 1
            evicting -= 1
            s = prev[s]
    return n


@njit(nogil=True, cache=True, error_model="numpy")
def tier_home_pages(ids, num_stripes, pages_per_stripe, out):
    """out[i] = the disk tier page (of the whole file) where ids[i]'s record goes first: its stripe's region,
    its home page there. Sorting rows by it makes a bulk load write the file in order."""
    for i in range(ids.shape[0]):
        h = key_hash(ids[i])
        out[i] = stripe_of_hash(h, num_stripes) * pages_per_stripe + _tier_home(h, pages_per_stripe)


@njit(nogil=True, cache=True, error_model="numpy")
def load_cold_stripe(new_keys, new_values, perm, lo, hi, index, keys, values, tier):
    """Insert rows straight into the disk tier (`EmbeddingStore.load_cold`); a key in memory has its row
    overwritten there instead (memory shadows the disk). Returns the rows that went to disk.

    The rows come sorted by page: each page is copied once into a 4 KiB buffer, takes all the rows bound for
    it, and is written back with one pwrite (two system calls a row made a 187.5M-row prefill take 429 s).
    A page written whole by one call is never seen half-written by a process that outlives this one."""
    tkeys, thdr, tmarks, per_page = tier[0], tier[2], tier[3], tier[4]
    width = values.shape[1]
    buf_keys = np.zeros(PAGE_BYTES // 8, np.uint64)  # the page being filled
    buf_vals = buf_keys.view(np.float32)
    cur = -1
    n = 0
    for j in range(lo, hi):
        i = perm[j]
        key = new_keys[i]
        s = _find(index, keys, key, key_hash(key))[0]
        if s >= 0:
            _copy_row(values, s, new_values, i, width)
            continue
        found, p, r = _tier_probe(tkeys, per_page, key, cur, buf_keys)
        if p < 0 or (not found and thdr[TF_ROWS] >= thdr[TF_LIMIT]):
            thdr[TF_OVERFLOWS] += 1
            continue
        if p != cur:
            if cur >= 0:
                _tier_write(tier, cur, 0, buf_keys.ctypes.data, PAGE_BYTES)
            for d in range(PAGE_BYTES // 8):
                buf_keys[d] = tkeys[p, d]
            cur = p
        base = _tier_base(per_page, r, width)
        for d in range(width):
            buf_vals[base + d] = new_values[i, d]
        if not found:
            buf_keys[r] = key + np.uint64(1)
            thdr[TF_ROWS] += 1
        tmarks[p * per_page + r] = 1
        n += 1
    if cur >= 0:
        _tier_write(tier, cur, 0, buf_keys.ctypes.data, PAGE_BYTES)
    return n


@njit(nogil=True, cache=True, error_model="numpy")
def tier_gather(ids, perm, lo, hi, slots, tier, rows, gperm, where):
    """For `update`: the rows on disk of the IDs not in memory (slots[j] == -1) into rows[k], their gradient's
    position into gperm[k] and their record into where[k]; their slots[j] become -2 (applied on disk).
    Returns k, the rows gathered."""
    tkeys, tvals, per_page = tier[0], tier[1], tier[4]
    width = rows.shape[1]
    k = 0
    for j in range(lo, hi):
        if slots[j] != -1:
            continue
        found, p, r = _tier_find(tkeys, per_page, ids[perm[j]])
        if not found:
            continue
        base = _tier_base(per_page, r, width)
        for d in range(width):
            rows[k, d] = tvals[p, base + d]
        gperm[k] = perm[j]
        where[k] = p * per_page + r
        slots[j] = -2
        k += 1
    return k


@njit(nogil=True, cache=True, error_model="numpy")
def tier_scatter(tier, rows, where, k):
    """Write back the first k rows `tier_gather` took (after the optimizer step), marking them changed."""
    thdr, tmarks, per_page = tier[2], tier[3], tier[4]
    width = rows.shape[1]
    for i in range(k):
        if _tier_write_row(tier, where[i] // per_page, where[i] % per_page, rows, i, width):
            tmarks[where[i]] = 1
    thdr[TF_DISK_UPDATES] += k


@njit(nogil=True, cache=True, error_model="numpy")
def copy_tier_rows(tier, first, last, index, keys, changed_only, clear, out_keys, out_values, at):
    """Copy the records of pages [first, last) whose key is not in memory (memory holds the newer row) into
    out_*[at:], only changed ones with `changed_only` (their pages alone are read); `clear`: clear the marks
    of those copied (a checkpoint's copy). Returns how many."""
    tkeys, tvals, tmarks, per_page = tier[0], tier[1], tier[3], tier[4]
    width = out_values.shape[1]
    n = at
    for p in range(first, last):
        for r in range(per_page):
            m = p * per_page + r
            if changed_only and tmarks[m] == 0:
                continue
            stored = tkeys[p, r]
            if stored == 0:
                break
            key = stored - np.uint64(1)
            if _find(index, keys, key, key_hash(key))[0] >= 0:
                if clear:  # its newer row in memory is marked (a fill marks it) and copied by the memory pass
                    tmarks[m] = 0
                continue
            out_keys[n] = key
            base = _tier_base(per_page, r, width)
            for d in range(width):
                out_values[n, d] = tvals[p, base + d]
            if clear:
                tmarks[m] = 0
            n += 1
    return n - at


@njit(inline="always", error_model="numpy")
def group_of(key):
    """Feature group (table) of an ID: its top 8 bits (hybridrec/core/wire/ids.py)."""
    return np.int64(key >> _GROUP_SHIFT)


@njit(inline="always", error_model="numpy")
def _sketch_cell(h, r, cols):
    """Column of row r of the count-min sketch for a key of hash h (double hashing, then multiply-shift)."""
    x = ((h & _U32_MASK) + np.uint64(r) * ((h >> _U32) | np.uint64(1))) & _U32_MASK
    return np.int64((x * np.uint64(cols)) >> _U32)


@njit(inline="always", error_model="numpy")
def _sketch_count(sketch, key, sketch_key):
    """An ID's count: the smallest of its counters (never below its true count since the last halving)."""
    h = fmix64(key ^ sketch_key)
    m = 255
    for r in range(sketch.shape[0]):
        v = np.int64(sketch[r, _sketch_cell(h, r, sketch.shape[1])])
        if v < m:
            m = v
    return m


@njit(inline="always", error_model="numpy")
def _sketch_add(sketch, key, sketch_key, hdr, window):
    """Count one occurrence of `key`; returns its new count (saturating at 255).

    Conservative update: only the counters at the minimum grow, which keeps
    other IDs' over-estimates smaller than a plain count-min increment. Every
    `window` occurrences the stripe's counters are halved (aging), so the
    sketch keeps counting the recent stream instead of filling up.
    """
    h = fmix64(key ^ sketch_key)
    cols = sketch.shape[1]
    m = 255
    for r in range(sketch.shape[0]):
        v = np.int64(sketch[r, _sketch_cell(h, r, cols)])
        if v < m:
            m = v
    new = m + 1 if m < 255 else 255
    for r in range(sketch.shape[0]):
        c = _sketch_cell(h, r, cols)
        if sketch[r, c] < new:
            sketch[r, c] = new
    hdr[F_SKETCH_ADDS] += 1
    if hdr[F_SKETCH_ADDS] >= window:
        for r in range(sketch.shape[0]):
            for c in range(cols):
                sketch[r, c] >>= 1
        hdr[F_SKETCH_ADDS] = 0
        hdr[F_SKETCH_HALVINGS] += 1
    return new


@njit(nogil=True, cache=True, error_model="numpy")
def sketch_counts_stripe(ids, perm, lo, hi, sketch, sketch_key, out):
    """out[perm[j]] = the sketch's count of ids[perm[j]] for j in [lo, hi) (no counting)."""
    for j in range(lo, hi):
        out[perm[j]] = _sketch_count(sketch, ids[perm[j]], sketch_key)


@njit(nogil=True, cache=True, error_model="numpy")
def lookup_stripe(ids, perm, lo, hi, slots, out, index, keys, prev, nxt, values, hdr, stamps, head_moves,
                  train, admit_threshold, admit_key, init_key, normal, scale, init_acc, acc_width, storage,
                  touched, sketch, tables, admit_after, sketch_key, window, now_clock, now_ms, tier, defer):
    """Copy the rows of ids[perm[lo:hi]] (all of this stripe) into `out`.

    Hits are resolved, copied and refreshed in separate passes (each pass's
    memory accesses are independent, so their misses overlap), then misses
    are handled one by one. Refreshing hits before inserting misses means a batch
    never evicts a row it reads itself (unless it has more new IDs than the
    stripe has slots).

    Lazy refresh: moving a row to the head costs four random writes (its
    neighbours' links and its own), more than copying it. A row needs the move
    only when it may have drifted past the middle of the list. `head_moves[0]`
    counts every move to this stripe's head (refreshes and inserts; a restore's
    are added by the caller) and `stamps[s]` holds the count at row s's last
    move, so s has at most `head_moves[0] - stamps[s]` rows ahead of it. A hit is
    moved when that bound, plus the moves this call may still make (hi - lo),
    reaches half the stripe's live rows; otherwise it stays where it is, in the
    first half, which this call cannot evict. A row is moved at most once per
    call (stamped during this call: stamps[s] >= the count at its start). So
    a row read at least once per half-list of moves is never evicted, as with
    an exact LRU at half the size; rows read less often are ordered exactly.
    admit_threshold < 0 admits everything; else a new ID is admitted when a
    53-bit draw is below it. Before that draw, an ID of a table whose
    admit_after[group] > 1 is counted in `sketch` and admitted only once its
    count reaches that threshold.
    With a disk tier (`tier`, see _tier_find), an ID not in memory is read from disk: a training lookup moves
    its row (with its optimizer state) into memory, where it then evicts a row to disk; a read-only one copies it.
    `defer`: stop after the hits, leaving the IDs not in memory (slots[j] < 0) to `insert_misses` (training) or
    `read_misses`, so that the caller can first have the kernel read the disk pages they need
    (`advise_pages`); head_moves[0] then holds the move count they continue from.
    """
    _resolve_and_copy(ids, perm, lo, hi, slots, out, index, keys, values, storage)
    moves0 = head_moves[0]
    moves = moves0
    if train:  # refresh hits: the list's head/tail stay in registers for the whole loop
        head = np.int32(hdr[F_HEAD])
        tail = np.int32(hdr[F_TAIL])
        recent = hdr[F_USED] // 2 - (hi - lo)
        for j in range(lo, hi):
            s = slots[j]
            if s < 0:
                continue
            stamp = np.int64(stamps[s])
            if stamp >= moves0 or moves - stamp < recent:  # moved in this call, or still in the list's first half
                continue
            stamps[s] = moves
            moves += 1
            if s != head:  # unlink s (it has a prev: it is not the head), push it at the head
                p = prev[s]
                n = nxt[s]
                nxt[p] = n
                if n >= 0:
                    prev[n] = p
                else:
                    tail = p
                prev[s] = -1
                nxt[s] = head
                prev[head] = s
                head = s
        hdr[F_HEAD] = head
        hdr[F_TAIL] = tail
        if tier is not None:
            tier[2][TF_LOOKUPS] += hi - lo
    if defer:
        head_moves[0] = moves
    elif not train:
        read_misses(ids, perm, lo, hi, slots, out, hdr, values.shape[1], tier, storage)
    else:
        head_moves[0] = insert_misses(ids, perm, lo, hi, slots, out, index, keys, prev, nxt, values, hdr, stamps,
                                      moves, admit_threshold, admit_key, init_key, normal, scale, init_acc, acc_width,
                                      storage, touched, sketch, tables, admit_after, sketch_key, window, now_clock, now_ms,
                                      tier)


@njit(nogil=True, cache=True, error_model="numpy")
def read_misses(ids, perm, lo, hi, slots, out, hdr, width, tier, storage):
    """A read-only lookup's IDs not in memory (slots[j] < 0): their rows on disk (`width` values a row), or
    zeros, counted as read misses."""
    dim = out.shape[1]
    row = np.empty((1, width), np.float32)
    for j in range(lo, hi):
        if slots[j] < 0:
            if tier is not None and _tier_get(tier, ids[perm[j]], row, 0, width, width):
                _copy_weights(out, perm[j], row, 0, dim, storage)
                tier[2][TF_DISK_READS] += 1
            else:
                _zero_row(out, perm[j])
                hdr[F_READ_MISSES] += 1


@njit(nogil=True, cache=True, error_model="numpy")
def insert_misses(ids, perm, lo, hi, slots, out, index, keys, prev, nxt, values, hdr, stamps, moves,
                   admit_threshold, admit_key, init_key, normal, scale, init_acc, acc_width, storage,
                   touched, sketch, tables, admit_after, sketch_key, window, now_clock, now_ms, tier):
    """Admit, insert and serve the IDs that `lookup_stripe` did not find (slots[j] < 0).

    Done in batches rather than ID by ID, so that the random index accesses of
    all evictions, then of all inserts, sit in tight loops whose cache misses
    overlap: (1) pick the distinct admitted new keys, in order of first
    occurrence (a small local hash set dedups them); (2) take that many slots:
    free ones, then the LRU tail's, removing the evicted keys from the index;
    (3) write each new row (its row on disk, with a disk tier, else its initial
    one), then publish its key; (4) index and link the new rows; (5) copy them
    out. The result is the same as inserting one by one. An ID with a row on
    disk was admitted before: it is not counted or drawn again.
    Returns the stripe's move count `moves` (see lookup_stripe) after the inserts.
    """
    dim = out.shape[1]
    cap = keys.shape[0]
    m = 0
    for j in range(lo, hi):
        if slots[j] < 0:
            m += 1
    if m == 0:
        return moves
    size = 2
    while size < 2 * m:  # local set at load factor <= 0.5
        size *= 2
    local_keys = np.empty(size, np.uint64)
    local_pos = np.full(size, -1, np.int64)
    new_keys = np.empty(m, np.uint64)
    n = 0
    for j in range(lo, hi):  # (1) slots[j] becomes -1 (dropped) or -2 - q for the q-th new key
        if slots[j] >= 0:
            continue
        key = ids[perm[j]]
        b = np.int64(key_hash(key) & np.uint64(size - 1))
        while local_pos[b] >= 0 and local_keys[b] != key:
            b = (b + 1) & (size - 1)
        if local_pos[b] >= 0:
            slots[j] = -2 - local_pos[b]
            continue
        g = group_of(key)
        if tier is not None and (admit_after[g] > 1 or admit_threshold >= 0) and _tier_find(tier[0], tier[4], key)[0]:
            pass  # admitted when it was first inserted: its row is on disk
        elif sketch is not None and admit_after[g] > 1 and \
                _sketch_add(sketch, key, sketch_key, hdr, window) < admit_after[g]:
            slots[j] = -1  # not seen often enough yet: reads zeros, its gradient will be dropped
            hdr[F_ADMISSION_DROPS] += 1
            tables[g, T_REJECTED] += 1
            continue
        elif admit_threshold >= 0 or key == EMPTY_KEY:  # each occurrence of a new ID gets a draw
            draw = fmix64(key ^ admit_key ^ fmix64(np.uint64(hdr[F_ADMIT_DRAWS])))
            hdr[F_ADMIT_DRAWS] += 1
            if key == EMPTY_KEY or np.int64(draw >> _U11) >= admit_threshold:
                slots[j] = -1
                hdr[F_ADMISSION_DROPS] += 1
                tables[g, T_REJECTED] += 1
                continue
        local_keys[b] = key
        local_pos[b] = n
        new_keys[n] = key
        slots[j] = -2 - n
        n += 1
    # More new keys than slots (tiny stores): the first ones would be inserted and evicted again
    # within this call; they are served from a scratch row and counted as such.
    ghosts = max(0, n - cap)
    width = values.shape[1]
    ghost_rows = np.empty((ghosts, width), np.float32)
    for q in range(ghosts):  # on disk they go straight back there
        if tier is not None and _tier_get(tier, new_keys[q], ghost_rows, q, width, width):
            tier[2][TF_FILLS] += 1
        else:
            init_row(ghost_rows, q, new_keys[q], dim, init_key, normal, scale, init_acc, acc_width, storage)
        if tier is not None:
            _tier_put(tier, new_keys[q], ghost_rows, q, width)
    hdr[F_INSERTS] += ghosts
    hdr[F_EVICTIONS] += ghosts
    if tier is not None:
        tier[2][TF_MISSES] += n
    for q in range(n):
        tables[group_of(new_keys[q]), T_ADMITTED] += 1
    new_slots = np.empty(n, np.int32)
    for q in range(ghosts, n):  # (2) free slots first, then evict from the LRU tail (to disk, with a tier)
        # _evict_slot tests the tier too, but only after numba has inlined its disk code: tested here, a store
        # without a tier never compiles it (row_storage.kernel_storage)
        if tier is not None:
            new_slots[q] = _evict_slot(keys, prev, nxt, values, hdr, tier)
        else:
            new_slots[q] = _take_slot(keys, prev, nxt, hdr)
    for q in range(ghosts, n):  # (3) rows are complete before their key is published (crash ordering)
        s = new_slots[q]
        if tier is not None and _tier_get(tier, new_keys[q], values, s, width, width):
            tier[2][TF_FILLS] += 1
        else:
            init_row(values, np.int64(s), new_keys[q], dim, init_key, normal, scale, init_acc, acc_width, storage)
        if touched.shape[0] > 0:  # a new row counts as updated now (TTL)
            touched[s, 0] = now_clock
            touched[s, 1] = now_ms
        keys[s] = new_keys[q]
    # (4) The evictions above may have pushed the stale entries over the sweep limit: then one
    # reindex covers every published key, new ones included. Otherwise, live + stale <= 3/4 of
    # the index after these inserts, so every probe still ends at an empty entry.
    indexed = _sweep_stale(index, keys, hdr)
    for q in range(ghosts, n):
        s = new_slots[q]
        if not indexed:
            key = new_keys[q]
            h = key_hash(key)
            index[_find(index, keys, key, h)[1]] = _entry(h, s)
        _push_head(prev, nxt, hdr, s)
        stamps[s] = moves
        moves += 1
    hdr[F_INSERTS] += n - ghosts
    for j in range(lo, hi):  # (5)
        c = slots[j]
        if c == -1:
            _zero_row(out, perm[j])
        elif c < -1:
            q = -2 - c
            if q < ghosts:
                _copy_weights(out, perm[j], ghost_rows, q, dim, storage)
            else:
                _copy_weights(out, perm[j], values, new_slots[q], dim, storage)
    return moves


@njit(nogil=True, cache=True, error_model="numpy")
def load_stripe(new_keys, new_values, new_touched, perm, lo, hi, index, keys, prev, nxt, values, hdr, touched, tier):
    """Insert rows verbatim (checkpoint restore); an existing key is overwritten and refreshed. With a disk
    tier, an evicted row goes to disk, and a row loaded into memory shadows its older copy there.

    `new_touched` (n, 2): each row's last update (store clock, unix ms), kept when the store has a TTL."""
    for j in range(lo, hi):
        i = perm[j]
        key = new_keys[i]
        s = _find(index, keys, key, key_hash(key))[0]
        if s >= 0:
            _copy_row(values, s, new_values, i, values.shape[1])
            _touch(prev, nxt, hdr, s)
        else:
            _sweep_stale(index, keys, hdr)  # before taking a slot: every slot in use holds its key
            s = _evict_slot(keys, prev, nxt, values, hdr, tier)
            _copy_row(values, s, new_values, i, values.shape[1])
            _insert(index, keys, prev, nxt, hdr, key, s)
        if touched.shape[0] > 0:
            touched[s, 0] = new_touched[i, 0]
            touched[s, 1] = new_touched[i, 1]


@njit(nogil=True, cache=True, error_model="numpy")
def resolve_stripe(ids, perm, lo, hi, slots, index, keys):
    """slots[j] = slot of ids[perm[j]] or -1 (for `update`, whose arithmetic is in optimizers.py)."""
    _resolve(ids, perm, lo, hi, slots, index, keys)


@njit(nogil=True, cache=True, error_model="numpy")
def after_update_stripe(ids, perm, lo, hi, slots, touched, tables, now_clock, now_ms):
    """After `update` applied a stripe's rows: stamp them as updated (TTL) and count, per table, the
    gradients of IDs without a row, which were dropped."""
    stamp = touched.shape[0] > 0
    for j in range(lo, hi):
        s = slots[j]
        if s == -1:  # -2: applied to its row on disk (tier_gather)
            tables[group_of(ids[perm[j]]), T_DROPPED] += 1
        elif stamp:
            touched[s, 0] = now_clock
            touched[s, 1] = now_ms


@njit(inline="always", error_model="numpy")
def _remove_slot(index, keys, prev, nxt, values, hdr, touched, stamps, marks, s):
    """Remove live slot s and keep rows compact in [0, used): the last used row moves into s.

    Crash ordering: s's key is cleared first (its index entry goes stale, as an
    eviction's does); the moved row is complete in s before its key is written
    there, and its old slot's key is cleared last, so a rebuild from `keys` sees
    the moved key once or twice (it drops the repeat), never with a partial row.
    """
    _unlink(prev, nxt, hdr, s)
    keys[s] = EMPTY_KEY
    hdr[F_STALE] += 1
    last = hdr[F_USED] - 1
    if last != s:
        key = keys[last]
        h = key_hash(key)
        b = _find(index, keys, key, h)[1]  # its entry, pointing to `last` (s holds no key now)
        _copy_row(values, s, values, last, values.shape[1])
        if touched.shape[0] > 0:
            touched[s, 0] = touched[last, 0]
            touched[s, 1] = touched[last, 1]
        stamps[s] = stamps[last]
        marks[s] = marks[last]
        keys[s] = key
        index[b] = _entry(h, s)
        p = prev[last]
        n = nxt[last]
        prev[s] = p
        nxt[s] = n
        if p >= 0:
            nxt[p] = s
        else:
            hdr[F_HEAD] = s
        if n >= 0:
            prev[n] = s
        else:
            hdr[F_TAIL] = s
        keys[last] = EMPTY_KEY
    hdr[F_USED] = last


@njit(nogil=True, cache=True, error_model="numpy")
def expire_stripe(index, keys, prev, nxt, values, hdr, touched, tables, stamps, marks, ttl_clock, ttl_ms,
                  now_clock, now_ms):
    """Remove the rows whose table's TTL has passed since their last update; returns how many.

    ttl_clock[g] / ttl_ms[g] <= 0: table g has no such limit. Slots are
    scanned from the last down, so the row that `_remove_slot` moves into a
    freed slot has been checked already. `marks` (the store's changed-row marks) move with their rows.
    """
    removed = 0
    s = hdr[F_USED] - 1
    while s >= 0:
        g = group_of(keys[s])
        if (ttl_clock[g] > 0 and now_clock - touched[s, 0] >= ttl_clock[g]) or \
                (ttl_ms[g] > 0 and now_ms - touched[s, 1] >= ttl_ms[g]):
            _remove_slot(index, keys, prev, nxt, values, hdr, touched, stamps, marks, s)
            tables[g, T_EXPIRED] += 1
            removed += 1
        s -= 1
    _sweep_stale(index, keys, hdr)
    return removed


# ---------------------------------------------------------------- recovery and checks
@njit(nogil=True, cache=True, error_model="numpy")
def rebuild_stripe(stripe, num_stripes, index, keys, prev, nxt, values, hdr, touched):
    """Recreate index, LRU list and `used` from `keys` alone (after a crash).

    Live rows are compacted to slots [0, used); keys that are empty, belong to
    another stripe or repeat are dropped. Recency is lost: the list follows slot order.
    """
    index[:] = EMPTY
    w = 0
    for r in range(keys.shape[0]):
        k = keys[r]
        if k == EMPTY_KEY:
            continue
        h = key_hash(k)
        found, b = _find(index, keys, k, h)  # the index holds the keys kept so far: detects repeats
        if stripe_of_hash(h, num_stripes) != stripe or found >= 0:
            keys[r] = EMPTY_KEY
            continue
        if r != w:
            _copy_row(values, w, values, r, values.shape[1])
            if touched.shape[0] > 0:
                touched[w, 0] = touched[r, 0]
                touched[w, 1] = touched[r, 1]
            keys[w] = k
            keys[r] = EMPTY_KEY
        index[b] = _entry(h, w)
        w += 1
    hdr[F_USED] = w
    _reindex(index, keys, hdr)
    for s in range(w):  # head = w - 1 ... tail = 0
        nxt[s] = s - 1
        prev[s] = s + 1 if s + 1 < w else -1
    hdr[F_HEAD] = w - 1
    hdr[F_TAIL] = 0 if w > 0 else -1
    return w


@njit(nogil=True, cache=True, error_model="numpy")
def check_stripe(stripe, num_stripes, index, keys, prev, nxt, hdr):
    """0 when index, keys and LRU list agree, else a code naming the first violation."""
    cap = keys.shape[0]
    used = hdr[F_USED]
    if used < 0 or used > cap:
        return 1
    for s in range(cap):
        k = keys[s]
        if s >= used:
            if k != EMPTY_KEY:
                return 2  # key beyond the used prefix
            continue
        if k == EMPTY_KEY:
            return 3  # hole inside the used prefix
        h = key_hash(k)
        if stripe_of_hash(h, num_stripes) != stripe:
            return 4  # key stored in the wrong stripe
        if _find(index, keys, k, h)[0] != s:
            return 5  # live key not found at its slot (or duplicated)
    n = 0
    for b in range(index.shape[0]):
        e = index[b]
        if e < EMPTY or (e >= 0 and (e & SLOT_MASK) >= cap):
            return 6  # garbage (stale entries may point to slots freed by expiry)
        n += e >= 0
    if n < used or n - used > hdr[F_STALE]:
        return 7  # every live row has an entry; the others are at most the evictions since the sweep
    count = 0
    p = -1
    s = hdr[F_HEAD]
    while s >= 0:
        if count >= used or s >= used or prev[s] != p:
            return 8  # cycle, free slot in the list, or broken back link
        p = s
        s = nxt[s]
        count += 1
    if count != used or hdr[F_TAIL] != p:
        return 9
    return 0


# ---------------------------------------------------------------- changed rows (incremental checkpoints)
@njit(nogil=True, cache=True, error_model="numpy")
def mark_slots(slots, lo, hi, marks):
    """marks[slots[j]] = 1 for j in [lo, hi) with a slot: the rows an update changed."""
    for j in range(lo, hi):
        s = slots[j]
        if s >= 0:
            marks[s] = 1


@njit(nogil=True, cache=True, error_model="numpy")
def mark_newest(nxt, hdr, n, marks):
    """Mark the `n` rows nearest the LRU head: a lookup's inserts, which it pushed there last."""
    s = hdr[F_HEAD]
    while s >= 0 and n > 0:
        marks[s] = 1
        n -= 1
        s = nxt[s]


@njit(nogil=True, cache=True, error_model="numpy")
def copy_rows(order, keys, values, touched, marks, out_keys, out_values, out_touched, at):
    """Copy the live rows of slots `order` into out_*[at:], clearing their marks; returns how many were live.

    A checkpoint's chunk, taken without the stripe's lock and kept only if no mutating call overlapped it
    (`EmbeddingStore._unchanged`): a slot emptied since `order` was taken is skipped, and a slot that changed
    owner is copied with its new key (each row whole, as it is now)."""
    n = at
    width = values.shape[1]
    stamp = touched.shape[0] > 0
    for i in range(order.shape[0]):
        s = order[i]
        key = keys[s]
        if key == EMPTY_KEY:
            continue
        out_keys[n] = key
        _copy_row(out_values, n, values, s, width)
        if stamp:
            out_touched[n, 0] = touched[s, 0]
            out_touched[n, 1] = touched[s, 1]
        marks[s] = 0
        n += 1
    return n - at


@njit(nogil=True, cache=True, error_model="numpy")
def lru_order(prev, hdr, out):
    """Live slots from least to most recently used (walks back from the tail)."""
    s = hdr[F_TAIL]
    n = 0
    while s >= 0 and n < out.shape[0]:
        out[n] = s
        n += 1
        s = prev[s]
    return n
