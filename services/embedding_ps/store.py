"""One PS shard's embedding table for one embedding width: the request path (docs/architecture.md#embedding-store).

On the embedding PS: `EmbeddingStore` serves lookups, updates, checkpoint
dumps/restores and stats from request threads. Its arrays live in files
mapped MAP_SHARED (by default below /dev/shm), so a restarted PS process
re-attaches to the same memory and an acknowledged update survives kill -9;
what those files hold, how they are sized, created, checked and re-attached,
and `StoreConfig` itself, are in store_files.py.

The table is split into stripes (a hash of the key, different from the shard
hash): each has its own lock, index region, slot range and LRU list, so
requests on different threads run their numba kernels (`kernels.py`, nogil)
on different cores. A stripe's dirty flag is set while a kernel mutates it;
a stripe found dirty on open is rebuilt from `keys` instead of trusted.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import numpy as np

from hybridrec.core.runtime import log
from hybridrec.core.config import Config
from services.embedding_ps import kernels as K
from services.embedding_ps import lifecycle as L
from services.embedding_ps import optimizers as O
from services.embedding_ps import row_storage as R
from services.embedding_ps.store_files import (GLOBAL_FIELDS, Layout, StoreConfig, as_ids, attach_files,
                                               create_files, file_dtype, file_nbytes, lock_directory, prefault)
from services.embedding_ps.tier import DiskTier

__all__ = ["EmbeddingStore", "StoreConfig", "init_rows"]

_log = log.get(__name__)

_INIT_SALT, _ADMIT_SALT, _ROUND_SALT = 0x1D5E, 0xAD317, 0x50D1
PRIVATE_BYTES_PER_SLOT = 5
"""Process memory a store holds per slot besides its files: the LRU stamps (uint32) and the changed-row
marks (uint8). `hybridrec plan` counts it."""
HEAD_MOVES_START = 1 << 31  # the move counters' start: above any stripe's slot count (see _head_moves)

_CHECK_MESSAGES = {
    1: "used row count out of range", 2: "key stored beyond the used slots", 3: "empty key inside the used slots",
    4: "key stored in the wrong stripe", 5: "live key not found at its slot by the index (or duplicated)",
    6: "index entry is garbage (points beyond the capacity)",
    7: "index entries missing, or more stale entries than evictions since the last sweep",
    8: "LRU list has a cycle, a free slot or a broken prev link", 9: "LRU list length or tail differs from rows",
}


def init_rows(ids: np.ndarray, *, dim: int, seed: int, distribution: str, scale: float,
              storage: int = R.FP32) -> np.ndarray:
    """The initial embeddings (n, dim) float32 the store gives these IDs (same kernel, same bits); `storage`:
    as a store of 16-bit weights (a row_storage code) holds them, rounded to nearest."""
    ids = as_ids(ids, "ids")
    words = np.empty((ids.shape[0], R.weight_words(dim, storage)), np.float32)
    K.init_rows_kernel(ids, words, dim, np.uint64(K.mix_seed(seed, _INIT_SALT)), distribution == "normal",
                       float(scale), R.kernel_storage(storage))
    return np.ascontiguousarray(R.decode_weights(words, dim, storage))


T = TypeVar("T")

COPY_TRIES = 8
"""Copies of one batch a dump discards (a request changed the stripe meanwhile) before it takes the lock."""
COPY_BACKOFF_S = 0.0005
"""The pause before a discarded copy is taken again: the overlapping request's kernel is about this long."""


def shard_tier_dir(shard_directory: Path, config: StoreConfig | Config) -> Path:
    """Where the disk tiers of the stores of the shard in `shard_directory` (`<ps.shm_dir>/shard-NNNNN`) live:
    the same name under ps.tier.dir."""
    return Path(config.ps.tier.dir) / shard_directory.name


def tier_dir_of(directory: Path, config: StoreConfig) -> Path:
    """Where the disk tier of the store in `directory` (`<ps.shm_dir>/shard-NNNNN/dim-D`) lives: its shard's
    `shard_tier_dir`, then the same name."""
    return shard_tier_dir(directory.parent, config) / directory.name


class EmbeddingStore(L.StoreLifecycle):
    """Array-based LRU embedding table in shared memory; thread-safe, one process at a time.

    Its lifecycle methods (clock, expiry, sketch) come from `lifecycle.StoreLifecycle`.

    On the embedding PS: the servicer calls `lookup`/`update` from request
    threads (never the event loop: the kernels take milliseconds).
    """

    def __init__(self, directory: Path, layout: Layout, maps: dict[str, mmap.mmap], lock_fd: int) -> None:
        self.directory = directory
        self.tier: DiskTier | None = None
        """The disk tier under the memory (ps.tier), opened by `open`; None: memory only."""
        self.created = False
        self.config = layout.config
        self._layout = layout
        self._maps = maps
        self._lock_fd = lock_fd
        self._closing = threading.Event()  # tells a prefault thread (store_files.prefault) to let go of the maps
        self._prefault: threading.Thread | None = None
        self._arrays = {name: np.frombuffer(mm, dtype=file_dtype(name)).reshape(layout.shape(name))
                        for name, mm in maps.items()}
        c = self.config
        self._rule = O.kernel_rule(c.optimizer, O.hyper_parameters(c.optimizer, c.ps.weight_bound))
        # numpy scalars, not Python ints: a Python int >= 2**63 sends numba's dispatcher down its
        # slow path (~1 ms of type inference per call).
        self._init_key = np.uint64(K.mix_seed(c.seed, _INIT_SALT))
        self._admit_key = np.uint64(K.mix_seed(c.seed, _ADMIT_SALT))
        self._round_key = int(K.mix_seed(c.seed, _ROUND_SALT))
        self._admit_threshold = -1 if c.ps.admit_probability >= 1.0 else int(c.ps.admit_probability * 2.0**53)
        self._locks = [threading.Lock() for _ in range(c.num_stripes)]
        # Per stripe: a sequence number that a mutating call makes odd while it runs and even again after it
        # (under the stripe's lock). A checkpoint copies rows WITHOUT the lock and keeps a copy only if the
        # number was even and unchanged across it (a seqlock), so no request ever waits for a dump's copy.
        self._seqs = np.zeros(c.num_stripes, np.int64)
        self._scratch = threading.local()
        # Per stripe: which call last refreshed each row (dedups LRU moves within a call).
        # Private memory: it means nothing after the call, so it is not part of the files.
        # One allocation (numpy puts large ones on transparent huge pages: fewer TLB misses), viewed per stripe.
        stamps = np.zeros(c.capacity, np.uint32)
        self._stamps = [stamps[a:b] for a, b in zip(layout.bases, layout.bases[1:])]
        # Moves to each stripe's LRU head (lazy refresh, see kernels.lookup_stripe). Process-local like the
        # stamps: starting above any stripe's size makes every zero stamp read as "moved long ago".
        self._head_moves = np.full((c.num_stripes, 1), HEAD_MOVES_START, np.int64)
        # Per slot: 1 when the row changed (updated, inserted) since the last checkpoint copied it; what an
        # incremental checkpoint writes. Process-local like the stamps: a restarted process knows no changes, so
        # its first checkpoint is full (`dumped` is None until a dump completes).
        marks = np.zeros(c.capacity, np.uint8)
        self._marks = [marks[a:b] for a, b in zip(layout.bases, layout.bases[1:])]
        self.longest_hold_s = 0.0
        """The longest the last `stream_rows` held a stripe's lock (0.0 when every copy was taken without it):
        what a lookup or update may have waited for the dump."""
        self.dump_copies = {"copies": 0, "retries": 0, "locked": 0}
        """The last `stream_rows`'s copies: taken without a lock, retried after a request changed the stripe
        meanwhile, and taken under the stripe's lock after `COPY_TRIES` retries."""
        self.dumped: int | None = None
        """Step of the last checkpoint dump of this store whose changes since are all marked (None: none, or
        something changed rows unmarked: a restore, a failed dump). Set by services/embedding_ps/checkpoint.py."""
        self._stripes = []  # per stripe: (index, keys, prev, next, values, header row) views
        self._life = []  # per stripe: (touched, sketch, tables) views; touched empty and sketch None when unused
        self._rules = L.rules_of(c)
        self._clock_lock = threading.Lock()
        a, m = self._arrays, layout.index_slots
        no_touched = np.zeros((0, 2), np.int64)
        for s in range(c.num_stripes):
            lo, hi = layout.bases[s], layout.bases[s + 1]
            hdr = a["header"][GLOBAL_FIELDS + s * K.STRIPE_FIELDS:GLOBAL_FIELDS + (s + 1) * K.STRIPE_FIELDS]
            self._stripes.append((a["index"][s * m:(s + 1) * m], a["keys"][lo:hi], a["prev"][lo:hi],
                                  a["next"][lo:hi], a["values"][lo:hi], hdr))
            self._life.append((a["touched"][lo:hi] if c.uses_ttl else no_touched,
                               a["sketch"][s] if c.uses_sketch else None, a["tables"][s]))

    # ------------------------------------------------------------ open / close
    @classmethod
    def open(cls, directory: str | Path, config: StoreConfig, *, tier_dir: str | Path | None = None
             ) -> "EmbeddingStore":
        """Create the store's files in `directory`, or re-attach to the ones there; with ps.tier, its disk tier
        too, in `tier_dir` (default: `tier_dir_of`). A store created afresh starts a fresh tier.

        Raises ValueError naming the field when existing files were made for
        another config, RuntimeError when another process has the store open,
        tier.CorruptTier when its disk tier cannot be trusted.
        Dirty stripes (a crash mid-mutation) are rebuilt from `keys`.
        """
        directory = Path(directory)
        lock_fd = lock_directory(directory)
        try:
            layout = Layout(config)
            maps = attach_files(directory, layout)
            created = maps is None
            if created:
                maps = create_files(directory, layout)
            store = cls(directory, layout, maps, lock_fd)
            store.created = created  # no files were there: a first start, or a lost store (lives.py)
            store._prefault = prefault(maps, directory, store._closing)
        except BaseException:
            os.close(lock_fd)
            raise
        try:
            if config.ps.tier is not None:
                store.tier = DiskTier.open(tier_dir if tier_dir is not None else tier_dir_of(directory, config),
                                             config, fresh=store.created)
            store._recover()
        except BaseException:
            store.close()
            raise
        return store

    def _recover(self) -> None:
        for s, (index, keys, prev, nxt, values, hdr) in enumerate(self._stripes):
            if hdr[K.F_DIRTY]:
                rows = K.rebuild_stripe(s, self.config.num_stripes, index, keys, prev, nxt, values, hdr,
                                        self._life[s][0])
                hdr[K.F_REBUILDS] += 1
                hdr[K.F_DIRTY] = 0
                _log.warning("rebuilt dirty stripe from keys", directory=str(self.directory), stripe=s, rows=rows)

    def flush(self) -> None:
        """msync every file (matters when the directory is on disk rather than tmpfs), and the disk tier's."""
        for mm in self._maps.values():
            mm.flush()
        if self.tier is not None:
            self.tier.flush()

    def close(self) -> None:
        """Flush and unmap. The caller must have stopped using the store from other threads."""
        if not self._maps:
            return
        self._closing.set()
        if self._prefault is not None:
            self._prefault.join()  # at most one chunk's madvise: then no view of the maps is left
        self.flush()
        if self.tier is not None:
            self.tier.close()
        self._stripes = []
        self._arrays = {}
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the map goes when it does
                pass
        self._maps = {}
        os.close(self._lock_fd)

    def __enter__(self) -> "EmbeddingStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ data path
    def _buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-thread perm/slot scratch, grown geometrically: no allocation per request."""
        perm = getattr(self._scratch, "perm", None)
        if perm is None or perm.shape[0] < n:
            size = max(n, 2 * (0 if perm is None else perm.shape[0]), 1024)
            self._scratch.perm = perm = np.empty(size, np.int32)
            self._scratch.slots = np.empty(size, np.int32)
        return perm[:n], self._scratch.slots[:n]

    def _run_stripes(self, offsets: np.ndarray, fn: Callable[[int, int, int], int], *, mutates: bool) -> int:
        """Call fn(stripe, lo, hi) under each non-empty stripe's lock; returns the sum of results.

        Stripes that another thread holds are skipped and retried, so two
        requests work on different stripes instead of queueing in lock order.
        """
        bounds = offsets.tolist()
        pending = [s for s in range(self.config.num_stripes) if bounds[s + 1] > bounds[s]]
        total = 0
        while pending:
            busy = []
            for s in pending:
                if self._locks[s].acquire(blocking=False):
                    try:
                        total += self._call(s, bounds, fn, mutates)
                    finally:
                        self._locks[s].release()
                else:
                    busy.append(s)
            if busy and len(busy) == len(pending):  # all taken: wait for one instead of spinning
                s = busy.pop(0)
                with self._locks[s]:
                    total += self._call(s, bounds, fn, mutates)
            pending = busy
        return total

    def _call(self, s: int, bounds: list[int], fn: Callable[[int, int, int], int], mutates: bool) -> int:
        if not mutates:
            return fn(s, bounds[s], bounds[s + 1]) or 0
        hdr, seqs = self._stripes[s][5], self._seqs
        failed = int(self.tier.counters[s, K.TF_WRITE_ERRORS]) if self.tier is not None else 0
        hdr[K.F_DIRTY] = 1
        seqs[s] += 1  # odd: a copy taken meanwhile is discarded (stream_rows)
        try:
            result = fn(s, bounds[s], bounds[s + 1])
        finally:
            seqs[s] += 1
        hdr[K.F_DIRTY] = 0  # left set if fn raised: the next open rebuilds the stripe
        if self.tier is not None:
            self.tier.check_writes(s, failed)
        return result or 0

    def _unchanged(self, s: int, copy: Callable[[], T]) -> T:
        """Run `copy()` (a read of stripe s) without its lock until no mutating call overlapped it; returns its
        result. After COPY_TRIES overlaps, runs it under the lock (counted, and its hold timed)."""
        seqs, counts = self._seqs, self.dump_copies
        counts["copies"] += 1
        for _ in range(COPY_TRIES):
            before = int(seqs[s])
            if before & 1 == 0:
                result = copy()
                if int(seqs[s]) == before:
                    return result
            counts["retries"] += 1
            time.sleep(COPY_BACKOFF_S)
        counts["locked"] += 1
        with self._locks[s]:
            held = time.perf_counter()
            result = copy()
            self.longest_hold_s = max(self.longest_hold_s, time.perf_counter() - held)
        return result

    def _region(self, s: int) -> tuple | None:
        """Stripe s's part of the disk tier as the kernels take it; None without one, for which numba compiles
        the kernels without their disk code (they test `tier is not None`; row_storage.kernel_storage says
        why that drops it)."""
        return self.tier.region(s) if self.tier is not None else None

    def _advise_tier(self, s: int, ids: np.ndarray, perm: np.ndarray, lo: int, hi: int, slots: np.ndarray,
                     train: bool) -> None:
        """Have the kernel read, all at once, the disk pages a lookup of stripe s is about to touch (its hits
        resolved in `slots`): those of its IDs not in memory and, training, of the rows they will evict (tier.py
        says why)."""
        _, keys, prev, _, _, hdr = self._stripes[s]
        K.advise_pages(ids, perm, lo, hi, slots, keys, prev, hdr, self._region(s), bool(train))

    def _head_moves_of(self, s: int, n: int) -> np.ndarray:
        """Stripe s's move counter (caller holds its lock), restarted with its stamps before n more
        moves could pass uint32."""
        if self._head_moves[s, 0] + n >= 2**32:
            self._stamps[s][:] = 0
            self._head_moves[s, 0] = HEAD_MOVES_START
        return self._head_moves[s]

    def lookup(self, ids: np.ndarray, *, train: bool, out: np.ndarray | None = None) -> np.ndarray:
        """Rows (n, dim) float32 of `ids` (1-D uint64, duplicates allowed).

        train=True: hits move to the LRU head; a new ID is admitted once its
        table's `admit_after` occurrences are counted (in the sketch), then with
        `admit_probability` (else it reads zeros and counts as an admission
        drop), initialised from (seed, id), evicting the stripe's least recently
        used row when full. train=False: read-only, absent IDs read zeros.
        """
        ids = as_ids(ids, "ids")
        n, dim = ids.shape[0], self.config.dim
        if out is None:
            out = np.empty((n, dim), np.float32)
        elif out.dtype != np.float32 or out.shape != (n, dim) or not out.flags.c_contiguous \
                or not out.flags.writeable:
            raise ValueError(f"out must be a writable C-contiguous float32 array of shape {(n, dim)}, "
                             f"got {out.dtype} {out.shape}")
        perm, slots = self._buffers(n)
        offsets = K.partition(ids, self.config.num_stripes, perm)
        c = self.config
        init, life = self._new_row_args()

        def run(s: int, lo: int, hi: int) -> int:
            hdr, region, tiered = self._stripes[s][5], self._region(s), self.tier is not None
            inserts = hdr[K.F_INSERTS]
            moves = self._head_moves_of(s, hi - lo)
            K.lookup_stripe(ids, perm, lo, hi, slots, out, *self._stripes[s], self._stamps[s], moves,
                            bool(train), self._admit_threshold, self._admit_key, *init, *self._life[s], *life,
                            region, tiered)
            if tiered:  # the IDs not in memory: their disk pages read at once, then their rows
                self._advise_tier(s, ids, perm, lo, hi, slots, train)
                if train:
                    moves[0] = K.insert_misses(ids, perm, lo, hi, slots, out, *self._stripes[s], self._stamps[s],
                                               moves[0], self._admit_threshold, self._admit_key, *init,
                                               *self._life[s], *life, region)
                else:
                    K.read_misses(ids, perm, lo, hi, slots, out, hdr, c.row_width, region, c.kernel_storage)
            if hdr[K.F_INSERTS] != inserts:  # new rows: at the LRU head, where the kernel pushed them last
                K.mark_newest(self._stripes[s][3], hdr, hdr[K.F_INSERTS] - inserts, self._marks[s])
            return 0

        self._run_stripes(offsets, run, mutates=bool(train))
        return out

    def _new_row_args(self) -> tuple[tuple, tuple]:
        """The kernels' arguments on new rows: (initialisation, lifecycle now), each a tuple of `insert_misses`."""
        c, r = self.config, self._rules
        init = (self._init_key, c.ps.init.distribution == "normal", c.ps.init.scale,
                c.optimizer.initial_accumulator_value, O.accumulator_width(c.optimizer, c.dim), c.kernel_storage)
        return init, (r.admit_after, r.sketch_key, r.window, np.int64(self.clock), np.int64(L.wall_ms()))

    def compile_inserts(self) -> None:
        """Compile (or load from the cache) `insert_misses`, the kernel that inserts a training lookup's new rows,
        without inserting anything: its one ID is a hit already (slot 0), so it returns at once and touches no
        row. The same argument types as `lookup_stripe`'s call of it, so it is the same signature; most of a
        cold warm-up's compile, which a warm-up helper does first, beside the lookups' kernel that calls it
        (services/embedding_ps/server.warm_up)."""
        init, life = self._new_row_args()
        moves = self._head_moves_of(0, 0)
        K.insert_misses(np.ones(1, np.uint64), np.zeros(1, np.int32), 0, 1, np.zeros(1, np.int32),
                        np.empty((1, self.config.dim), np.float32), *self._stripes[0], self._stamps[0], moves[0],
                        self._admit_threshold, self._admit_key, *init, *self._life[0], *life, self._region(0))

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply one optimizer step per row; returns rows applied (absent IDs are skipped and counted
        per table as dropped gradients). With a TTL, the rows count as updated now.

        `ids` should be unique (the embedding worker aggregates gradients per
        ID); a repeated ID simply gets two steps, in order.
        """
        ids = as_ids(ids, "ids")
        n, dim = ids.shape[0], self.config.dim
        if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.shape != (n, dim):
            desc = f"{grads.dtype} {grads.shape}" if isinstance(grads, np.ndarray) else type(grads).__name__
            raise ValueError(f"grads must be a float32 array of shape {(n, dim)} matching ids, got {desc}")
        grads = np.require(grads, requirements=["C", "W"])
        perm, slots = self._buffers(n)
        offsets = K.partition(ids, self.config.num_stripes, perm)
        rule, storage = self._rule, self.config.kernel_storage
        stamp = self.config.uses_ttl
        now = (np.int64(self.clock), np.int64(L.wall_ms()))

        def run(s: int, lo: int, hi: int) -> int:
            index, keys, _, _, values, hdr = self._stripes[s]
            K.resolve_stripe(ids, perm, lo, hi, slots, index, keys)
            round_key = self._round_key_of(hdr) if storage is not None else np.uint64(0)  # fp32 rounds nothing
            applied = O.apply_stripe(perm, lo, hi, slots, grads, values, *rule, dim, storage, ids, round_key)
            K.mark_slots(slots, lo, hi, self._marks[s])
            if self.tier is not None and applied < hi - lo:
                applied += self._update_on_disk(s, ids, perm, lo, hi, slots, grads, round_key)
            hdr[K.F_MISSING_UPDATES] += hi - lo - applied
            if stamp or applied < hi - lo:  # rows' update times (TTL); dropped gradients per table
                touched, _, tables = self._life[s]
                K.after_update_stripe(ids, perm, lo, hi, slots, touched, tables, *now)
            return applied

        return self._run_stripes(offsets, run, mutates=True)

    def _gather_from_disk(self, s: int, ids: np.ndarray, perm: np.ndarray, lo: int, hi: int,
                          slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(rows with state, their positions in `ids`, their records, k) of the first k IDs of stripe s not in
        memory (slots[j] == -1) that have a row on disk (`kernels.tier_gather`)."""
        rows = np.empty((hi - lo, self.config.row_width), np.float32)
        gperm, where = np.empty(hi - lo, np.int32), np.empty(hi - lo, np.int64)
        k = K.tier_gather(ids, perm, lo, hi, slots, self._region(s), rows, gperm, where)
        return rows, gperm, where, k

    def _update_on_disk(self, s: int, ids: np.ndarray, perm: np.ndarray, lo: int, hi: int, slots: np.ndarray,
                        grads: np.ndarray, round_key: np.uint64) -> int:
        """Apply the gradients of IDs that left memory since their lookup to their rows on disk (evicted in
        between: with a tier, no gradient is dropped for it); returns how many."""
        rows, gperm, where, k = self._gather_from_disk(s, ids, perm, lo, hi, slots)
        if k:
            c = self.config
            O.apply_stripe(gperm, 0, k, np.arange(k, dtype=np.int32), grads, rows, *self._rule, c.dim,
                           c.kernel_storage, ids, round_key)
            K.tier_scatter(self._region(s), rows, where, np.int64(k))
        return k

    def _round_key_of(self, hdr: np.ndarray) -> np.uint64:
        """The rounding key of a stripe's next update (under its lock): the store's, moved on by the stripe's
        update count, so every update of a 16-bit store draws afresh and a run reproduces."""
        hdr[K.F_ROUNDS] += 1
        return np.uint64((self._round_key + int(hdr[K.F_ROUNDS]) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)

    def peek(self, ids: np.ndarray, *, state: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(rows (n, dim) float32, found (n,) bool) of `ids`: admits nothing, refreshes no recency, counts
        no read miss (for publishing model versions; absent IDs read zeros). `state`: whole rows, (n,
        row_width) with the optimizer state, as `load_rows` takes them (a replicated update)."""
        ids = as_ids(ids, "ids")
        n, dim = ids.shape[0], (self.config.row_width if state else self.config.dim)
        storage = R.FP32 if state else self.config.storage_code
        out = np.zeros((n, dim), np.float32)
        found = np.zeros(n, bool)
        perm = np.empty(n, np.int32)
        slots = np.empty(n, np.int32)
        offsets = K.partition(ids, self.config.num_stripes, perm)

        def run(s: int, lo: int, hi: int) -> int:
            index, keys, _, _, values, _ = self._stripes[s]
            K.resolve_stripe(ids, perm, lo, hi, slots, index, keys)
            at, where = perm[lo:hi], slots[lo:hi]
            hit = where >= 0
            out[at[hit]] = R.decode_weights(values[where[hit]], dim, storage)
            found[at[hit]] = True
            if self.tier is not None and not hit.all():  # the rows on disk (read only: nothing changes)
                rows, gperm, _, k = self._gather_from_disk(s, ids, perm, lo, hi, slots)
                out[gperm[:k]] = R.decode_weights(rows[:k], dim, storage)
                found[gperm[:k]] = True
            return 0

        self._run_stripes(offsets, run, mutates=False)
        return out, found

    # ------------------------------------------------------------ checkpoints and checks
    def _all_locks(self):
        store = self

        class _Held:
            def __enter__(self):
                for lock in store._locks:
                    lock.acquire()

            def __exit__(self, *exc):
                for lock in reversed(store._locks):
                    lock.release()

        return _Held()

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of all live (keys, values incl. state), each stripe from least to most recently
        used, so `load_rows` of the result restores the recency order too."""
        keys, values, _ = self.snapshot()
        return keys, values

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """`items` plus each row's last update (int64 (n, 2): store clock, unix ms; None without a TTL),
        taken under every stripe lock: one consistent copy of the rows and their ages. The whole table, twice
        over while it is concatenated: for tests, small tables and full published versions; checkpoints
        stream instead (`stream_rows`)."""
        keys_out, values_out, touched_out = [], [], []
        with self._all_locks():
            for s, ((index, keys, prev, _, values, hdr), (touched, _, _)) in enumerate(zip(self._stripes, self._life)):
                if self.tier is not None:  # the rows only on disk first: older than any in memory
                    region = self._region(s)
                    on_disk = int(region[2][K.TF_ROWS])
                    out_k, out_v = np.empty(on_disk, np.uint64), np.empty((on_disk, values.shape[1]), np.float32)
                    n = K.copy_tier_rows(region, 0, region[0].shape[0], index, keys, False, False, out_k, out_v, 0)
                    keys_out.append(out_k[:n])
                    values_out.append(out_v[:n])
                order = np.empty(int(hdr[K.F_USED]), np.int64)
                order = order[:K.lru_order(prev, hdr, order)]
                keys_out.append(keys[order])
                values_out.append(values[order])
                touched_out.append(touched[order] if self.config.uses_ttl else touched[:0])
        touched = np.concatenate(touched_out) if self.config.uses_ttl else None
        return np.concatenate(keys_out), np.concatenate(values_out), touched

    def stream_rows(self, *, changed_only: bool = False, chunk_rows: int = 1 << 19,
                    batch_rows: int = 1 << 15) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """A checkpoint's copy of the live rows, in chunks of at most `chunk_rows`: (keys, values with state,
        touched or None without a TTL), each a view of a buffer that the next chunk overwrites (write it first).

        Stripe by stripe: the stripe's LRU links are copied (4 bytes a slot) and walked; then its rows are
        copied in that order, `batch_rows` at a time. No copy takes the stripe's lock: each is kept only if no
        mutating call overlapped it and is taken again otherwise (`_unchanged`, a seqlock; after COPY_TRIES
        overlaps, under the lock), so lookups and updates never wait for the dump, and every copy is a state
        the stripe was in. Extra memory: the chunk buffers plus 13 bytes per slot of one stripe
        (`checkpoint.dump_memory_bytes`). Each row is copied whole, as it is at its batch's copy; a row changed
        after its batch was copied is marked again and goes into the next delta. Rows inserted into a stripe
        after its links were copied are left for the next dump (still marked), and a row evicted and inserted
        again meanwhile may be copied twice (its newer copy comes later: a restore keeps it). Order within a
        stripe is least to most recently used, as `load_rows` then restores it.
        `changed_only`: only rows marked as changed (updated or inserted) since the previous stream; every
        copied row's mark is cleared (a discarded copy's clears are made again by the copy that is kept, which
        holds those rows as the overlapping request left them).
        """
        batch_rows = max(1, min(batch_rows, chunk_rows))
        if self.tier is not None and chunk_rows < self.tier.layout.per_page:
            raise ValueError(f"chunk_rows ({chunk_rows}) must hold a disk tier page's {self.tier.layout.per_page} rows")
        self.longest_hold_s = 0.0
        self.dump_copies = dict.fromkeys(self.dump_copies, 0)
        width, ttl = self.config.row_width, self.config.uses_ttl
        out_keys = np.empty(chunk_rows, np.uint64)
        out_values = np.empty((chunk_rows, width), np.float32)
        out_touched = np.empty((chunk_rows if ttl else 0, 2), np.int64)
        filled = 0
        for s, (index, keys, prev, _, values, hdr) in enumerate(self._stripes):
            if self.tier is not None:  # the rows only on disk first: a restore loads them before the newer ones
                region, per_page = self._region(s), self.tier.layout.per_page
                pages, step = region[0].shape[0], max(1, batch_rows // per_page)
                for first in range(0, pages, step):
                    last = min(first + step, pages)
                    if filled + (last - first) * per_page > chunk_rows:
                        yield out_keys[:filled], out_values[:filled], None
                        filled = 0
                    at = filled
                    filled += self._unchanged(s, lambda: K.copy_tier_rows(
                        region, first, last, index, keys, changed_only, True, out_keys, out_values, at))
            touched, marks = self._life[s][0], self._marks[s]
            links, ends = self._links_of(s)
            order = np.empty(links.shape[0], np.int32)
            order = order[:K.lru_order(links, ends, order)]
            del links
            if changed_only:
                order = order[marks[order] != 0]  # read without the lock: a mark set later stays for the next
            for a in range(0, order.shape[0], batch_rows):
                batch = order[a:a + batch_rows]
                if filled + batch.shape[0] > chunk_rows:
                    yield out_keys[:filled], out_values[:filled], out_touched[:filled] if ttl else None
                    filled = 0
                at = filled
                filled += self._unchanged(s, lambda: K.copy_rows(batch, keys, values, touched, marks, out_keys,
                                                                 out_values, out_touched, at))
        if filled:
            yield out_keys[:filled], out_values[:filled], out_touched[:filled] if ttl else None

    def _links_of(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Stripe s's LRU links of its live slots and its header, copied together (`_unchanged`)."""
        prev, hdr = self._stripes[s][2], self._stripes[s][5]
        # live rows occupy slots [0, used): so do their links
        return self._unchanged(s, lambda: (prev[:int(hdr[K.F_USED])].copy(), hdr.copy()))

    def changed_rows(self) -> int:
        """Live rows marked as changed since the last checkpoint copied them, in memory and on disk (read
        without locks)."""
        on_disk = sum(int(np.count_nonzero(self._region(s)[3])) for s in range(len(self._stripes))) if self.tier else 0
        return on_disk + sum(int(np.count_nonzero(m[:int(hdr[K.F_USED])]))
                             for m, (*_, hdr) in zip(self._marks, self._stripes))

    def _checked_rows(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = as_ids(keys, "keys")
        shape = (keys.shape[0], self.config.row_width)
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != shape:
            desc = f"{values.dtype} {values.shape}" if isinstance(values, np.ndarray) else type(values).__name__
            raise ValueError(f"values must be float32 of shape {shape} (dim + optimizer state), got {desc}")
        if np.any(keys == K.EMPTY_KEY):
            raise ValueError(f"key {int(K.EMPTY_KEY):#x} is reserved for empty slots and cannot be stored")
        return keys, np.require(values, requirements=["C", "W"])

    def load_cold(self, keys: np.ndarray, values: np.ndarray) -> int:
        """Insert rows as the table's coldest, straight into the disk tier (a restore's or a prefill's rows
        beyond what memory holds), sorted so that the file is written in order: a bulk load at disk speed
        where `load_rows` would evict each to a random page. A key in memory has its row overwritten there.
        Returns the rows written to disk (fewer: the tier was full, counted as overflows)."""
        if self.tier is None:
            raise ValueError(f"embedding store {self.directory} has no disk tier (ps.tier) to load rows into")
        keys, values = self._checked_rows(keys, values)
        pages = np.empty(keys.shape[0], np.int64)
        K.tier_home_pages(keys, self.config.num_stripes, self.tier.layout.pages_per_stripe, pages)
        if np.any(pages[1:] < pages[:-1]):  # a caller may have sorted them already (a prefill)
            order = np.argsort(pages, kind="stable")
            keys, values = keys[order], values[order]
        perm = np.empty(keys.shape[0], np.int32)
        offsets = K.partition(keys, self.config.num_stripes, perm)  # stable: each stripe's rows stay in page order
        self.dumped = None  # rows change without marks in memory: the next checkpoint must be full

        def run(s: int, lo: int, hi: int) -> int:
            index, skeys, _, _, svalues, _ = self._stripes[s]
            return K.load_cold_stripe(keys, values, perm, lo, hi, index, skeys, svalues, self._region(s))

        return self._run_stripes(offsets, run, mutates=True)

    def load_rows(self, keys: np.ndarray, values: np.ndarray, touched: np.ndarray | None = None) -> None:
        """Insert rows verbatim (checkpoint restore); present keys are overwritten; a full stripe evicts (to the
        disk tier, with one).

        `touched` (n, 2) int64: the rows' last updates (store clock, unix ms) as `snapshot` gave them;
        None: they count as updated now. Ignored by a store without a TTL."""
        keys, values = self._checked_rows(keys, values)
        if touched is None:
            touched = np.empty((keys.shape[0], 2), np.int64)
            touched[:, 0], touched[:, 1] = self.clock, L.wall_ms()
        elif touched.dtype != np.int64 or touched.shape != (keys.shape[0], 2):
            raise ValueError(f"touched must be int64 of shape {(keys.shape[0], 2)}, got {touched.dtype} "
                             f"{touched.shape}")
        touched = np.require(touched, requirements=["C", "W"])
        perm = np.empty(keys.shape[0], np.int32)
        offsets = K.partition(keys, self.config.num_stripes, perm)
        self.dumped = None  # rows change without marks: the next checkpoint must be full

        def run(s: int, lo: int, hi: int) -> int:
            K.load_stripe(keys, values, touched, perm, lo, hi, *self._stripes[s], self._life[s][0], self._region(s))
            self._head_moves_of(s, 0)[0] += hi - lo  # its moves to the head count too (their rows keep old stamps)
            return 0

        self._run_stripes(offsets, run, mutates=True)

    def check_consistency(self) -> None:
        """Raise AssertionError naming the stripe and fault if index, keys and LRU lists disagree."""
        with self._all_locks():
            for s, (index, keys, prev, nxt, _, hdr) in enumerate(self._stripes):
                code = K.check_stripe(s, self.config.num_stripes, index, keys, prev, nxt, hdr)
                if code:
                    raise AssertionError(f"embedding store {self.directory} stripe {s}: {_CHECK_MESSAGES[code]}")
                if hdr[K.F_DIRTY]:
                    raise AssertionError(f"embedding store {self.directory} stripe {s} is marked dirty")

    @property
    def shm_bytes(self) -> int:
        """Bytes of all files backing the store."""
        return sum(file_nbytes(self._layout, name) for name in self._layout.file_names)

    @property
    def num_rows(self) -> int:
        """Live rows (no lock: a snapshot)."""
        return sum(int(hdr[K.F_USED]) for *_, hdr in self._stripes)

    @property
    def table_rows(self) -> int:
        """Rows in memory plus records on disk (a row in both counts twice: an upper bound of the table)."""
        return self.num_rows + (self.tier.num_rows if self.tier is not None else 0)

    def stats(self) -> dict:
        """Counters summed over stripes (read without locks: a snapshot, not a transaction)."""
        rows = np.stack([hdr for *_, hdr in self._stripes]).sum(axis=0)
        used = [int(hdr[K.F_USED]) for *_, hdr in self._stripes]
        return {
            "rows": int(rows[K.F_USED]), "capacity": self.config.capacity, "dim": self.config.dim,
            "state_width": O.state_width(self.config.optimizer, self.config.dim),
            "row_bytes": 4 * self.config.row_width, "storage": str(self.config.ps.storage),
            "optimizer": self.config.optimizer.name.value, "num_stripes": self.config.num_stripes,
            "evictions": int(rows[K.F_EVICTIONS]), "inserts": int(rows[K.F_INSERTS]),
            "admission_drops": int(rows[K.F_ADMISSION_DROPS]), "missing_updates": int(rows[K.F_MISSING_UPDATES]),
            "read_misses": int(rows[K.F_READ_MISSES]), "rebuilds": int(rows[K.F_REBUILDS]),
            "index_stale_entries": int(rows[K.F_STALE]),
            "stripe_rows_min": min(used), "stripe_rows_max": max(used), "shm_bytes": self.shm_bytes,
            "clock": self.clock, "sketch_bytes": file_nbytes(self._layout, "sketch") if self.config.uses_sketch else 0,
            "sketch_halvings": int(rows[K.F_SKETCH_HALVINGS]) // self.config.num_stripes,
            "tables": self.table_stats(),
            "tier": self.tier.stats() if self.tier is not None else None,
        }

