"""One PS shard's embedding table for one embedding width (DESIGN §2).

On the embedding PS: every array lives in a file under a directory (by
default below /dev/shm) mapped MAP_SHARED, so a restarted PS process
re-attaches to the same memory and an acknowledged update survives kill -9.

Files: `header.bin` (int64: global fields, then one row per stripe with its
dirty flag, LRU head/tail and counters), `index.bin` (int32 open-addressing
hash index, key -> slot plus a 7-bit hash tag, -1 empty, linear probing;
evictions leave stale entries that a periodic sweep drops, see
kernels._reindex), `keys.bin` (uint64 slot -> key, EMPTY_KEY when free),
`prev.bin`/`next.bin` (int32 array-based LRU list) and `values.bin` (float32
slot -> embedding then optimizer state).

The table is split into stripes (a hash of the key, different from the shard
hash): each has its own lock, index region, slot range and LRU list, so
requests on different threads run their numba kernels (`kernels.py`, nogil)
on different cores. A stripe's dirty flag is set while a kernel mutates it;
a stripe found dirty on open is rebuilt from `keys` instead of trusted.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from hybridrec import log
from services.embedding_ps import kernels as K
from services.embedding_ps import optimizers as O
from services.embedding_ps.optimizers import OPTIMIZER_CODES, OptimizerSpec

_log = log.get(__name__)

DEFAULT_SHM_ROOT = Path("/dev/shm/hybridrec")
"""Where the PS puts its stores unless configured otherwise (tmpfs: RAM, survives a process restart)."""
MAGIC = int.from_bytes(b"HYRECPS\x01", "little")
LAYOUT_VERSION = 2
# Global header fields (int64), followed by num_stripes rows of kernels.STRIPE_FIELDS.
H_MAGIC, H_VERSION, H_DIM, H_CAPACITY, H_OPTIMIZER, H_STATE_WIDTH, H_NUM_STRIPES, H_SEED, H_INDEX_SLOTS = range(9)
GLOBAL_FIELDS = 16
_DATA_FILES = {"index": np.int32, "keys": np.uint64, "prev": np.int32, "next": np.int32, "values": np.float32}
_INIT_SALT, _ADMIT_SALT = 0x1D5E, 0xAD317
_CHECK_MESSAGES = {
    1: "used row count out of range", 2: "key stored beyond the used slots", 3: "empty key inside the used slots",
    4: "key stored in the wrong stripe", 5: "live key not found at its slot by the index (or duplicated)",
    6: "index entry is garbage or points to a free slot",
    7: "index entries missing, or more stale entries than evictions since the last sweep",
    8: "LRU list has a cycle, a free slot or a broken prev link", 9: "LRU list length or tail differs from rows",
}


@dataclass(frozen=True)
class StoreConfig:
    """Shape and behaviour of one store.

    dim, capacity, optimizer name, seed and num_stripes are recorded in the
    files and must match on re-attach; the others (hyper-parameters included)
    may change between runs.
    """

    dim: int
    """Embedding width."""
    capacity: int
    """Rows the store holds before it evicts least recently used ones."""
    optimizer: OptimizerSpec
    """Optimizer applied by `update`; decides the state stored after each row."""
    seed: int = 0
    """Seed of the deterministic initialisation and admission draws."""
    init_distribution: Literal["uniform", "normal"] = "uniform"
    """Distribution of a new row: uniform(-scale, scale) or normal(0, scale)."""
    init_scale: float = 0.01
    """Half-width (uniform) or standard deviation (normal) of new rows."""
    admit_probability: float = 1.0
    """Chance that a train lookup of a new ID inserts it; an ID seen k times gets in with 1-(1-p)^k."""
    weight_bound: float | None = None
    """Clip weights to [-bound, bound] after each update; None: no clipping."""
    num_stripes: int = 16
    """Independently locked parts of the table (parallelism across request threads)."""

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"store dim must be >= 1, got {self.dim}")
        if self.num_stripes < 1:
            raise ValueError(f"store num_stripes must be >= 1, got {self.num_stripes}")
        if self.capacity < self.num_stripes:
            raise ValueError(f"store capacity ({self.capacity}) must be >= num_stripes ({self.num_stripes})")
        if -(-self.capacity // self.num_stripes) > K.MAX_STRIPE_ROWS:
            raise ValueError(f"store capacity per stripe must be <= {K.MAX_STRIPE_ROWS}: raise num_stripes "
                             f"(capacity {self.capacity}, num_stripes {self.num_stripes})")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"store seed must be in [0, 2**63), got {self.seed}")
        if self.init_distribution not in ("uniform", "normal"):
            raise ValueError(f"store init_distribution must be 'uniform' or 'normal', got {self.init_distribution!r}")
        if not self.init_scale >= 0:
            raise ValueError(f"store init_scale must be >= 0, got {self.init_scale}")
        if not 0.0 <= self.admit_probability <= 1.0:
            raise ValueError(f"store admit_probability must be in [0, 1], got {self.admit_probability}")
        if self.weight_bound is not None and not self.weight_bound > 0:
            raise ValueError(f"store weight_bound must be > 0 or None, got {self.weight_bound}")

    @property
    def row_width(self) -> int:
        """float32 values per row: the embedding, then the optimizer state."""
        return self.dim + self.optimizer.state_width(self.dim)


def init_rows(ids: np.ndarray, *, dim: int, seed: int, distribution: str, scale: float) -> np.ndarray:
    """The initial embeddings (n, dim) float32 the store gives these IDs (same kernel, same bits)."""
    ids = _as_ids(ids, "ids")
    out = np.empty((ids.shape[0], dim), np.float32)
    K.init_rows_kernel(ids, out, np.uint64(K.mix_seed(seed, _INIT_SALT)), distribution == "normal", float(scale))
    return out


def _as_ids(ids: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        desc = f"{ids.dtype} array of shape {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"{what} must be a 1-D uint64 numpy array, got {desc}")
    # Contiguous and writable: read-only arrays (np.frombuffer of a request) are another numba type,
    # which would cost a second compilation on the first request; the copy is cheap next to a lookup.
    return np.require(ids, requirements=["C", "W"])


@dataclass
class _Layout:
    """Sizes derived from a config: stripe s owns slots [bases[s], bases[s+1])."""

    config: StoreConfig
    index_slots: int = 0  # per stripe, a power of two >= 2 * largest stripe (live entries <= 1/2), >= 8
    bases: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        self.bases = [s * c.capacity // c.num_stripes for s in range(c.num_stripes + 1)]
        largest = max(b - a for a, b in zip(self.bases, self.bases[1:]))
        self.index_slots = max(8, 1 << (2 * largest - 1).bit_length())

    def shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        return {"header": (GLOBAL_FIELDS + c.num_stripes * K.STRIPE_FIELDS,),
                "index": (c.num_stripes * self.index_slots,), "values": (c.capacity, c.row_width)
                }.get(name, (c.capacity,))

    def expected_header(self) -> dict[int, tuple[str, int]]:
        c = self.config
        return {H_VERSION: ("layout version", LAYOUT_VERSION), H_DIM: ("dim", c.dim),
                H_CAPACITY: ("capacity", c.capacity), H_OPTIMIZER: ("optimizer", c.optimizer.code),
                H_STATE_WIDTH: ("state width", c.optimizer.state_width(c.dim)),
                H_NUM_STRIPES: ("num_stripes", c.num_stripes), H_SEED: ("seed", c.seed),
                H_INDEX_SLOTS: ("index slots per stripe", self.index_slots)}


def _map_file(path: Path, nbytes: int, *, create: bool) -> mmap.mmap:
    """MAP_SHARED mapping of a file, pre-faulted (MAP_POPULATE) so the hot path takes no page faults."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            try:  # reserve tmpfs pages now: a full /dev/shm fails here, not as SIGBUS mid-training
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystem without fallocate
                    raise OSError(exc.errno, f"cannot reserve {nbytes} bytes for {path}: {exc.strerror}") from exc
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path} has {os.fstat(fd).st_size} bytes, expected {nbytes} (truncated or foreign file)")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class EmbeddingStore:
    """Array-based LRU embedding table in shared memory; thread-safe, one process at a time.

    On the embedding PS: the servicer calls `lookup`/`update` from request
    threads (never the event loop: the kernels take milliseconds).
    """

    def __init__(self, directory: Path, layout: _Layout, maps: dict[str, mmap.mmap], lock_fd: int) -> None:
        self.directory = directory
        self.config = layout.config
        self._layout = layout
        self._maps = maps
        self._lock_fd = lock_fd
        self._arrays = {name: np.frombuffer(mm, dtype=np.int64 if name == "header" else _DATA_FILES[name]
                                            ).reshape(layout.shape(name)) for name, mm in maps.items()}
        c = self.config
        self._hp = c.optimizer.hyper_parameters(c.weight_bound)
        # numpy scalars, not Python ints: a Python int >= 2**63 sends numba's dispatcher down its
        # slow path (~1 ms of type inference per call).
        self._init_key = np.uint64(K.mix_seed(c.seed, _INIT_SALT))
        self._admit_key = np.uint64(K.mix_seed(c.seed, _ADMIT_SALT))
        self._admit_threshold = -1 if c.admit_probability >= 1.0 else int(c.admit_probability * 2.0**53)
        self._locks = [threading.Lock() for _ in range(c.num_stripes)]
        self._scratch = threading.local()
        # Per stripe: which call last refreshed each row (dedups LRU moves within a call).
        # Private memory: it means nothing after the call, so it is not part of the files.
        # One allocation (numpy puts large ones on transparent huge pages: fewer TLB misses), viewed per stripe.
        stamps = np.zeros(c.capacity, np.uint32)
        self._stamps = [stamps[a:b] for a, b in zip(layout.bases, layout.bases[1:])]
        self._serials = [0] * c.num_stripes
        self._stripes = []  # per stripe: (index, keys, prev, next, values, header row) views
        a, m = self._arrays, layout.index_slots
        for s in range(c.num_stripes):
            lo, hi = layout.bases[s], layout.bases[s + 1]
            hdr = a["header"][GLOBAL_FIELDS + s * K.STRIPE_FIELDS:GLOBAL_FIELDS + (s + 1) * K.STRIPE_FIELDS]
            self._stripes.append((a["index"][s * m:(s + 1) * m], a["keys"][lo:hi], a["prev"][lo:hi],
                                  a["next"][lo:hi], a["values"][lo:hi], hdr))

    # ------------------------------------------------------------ open / close
    @classmethod
    def open(cls, directory: str | Path, config: StoreConfig) -> "EmbeddingStore":
        """Create the store's files in `directory`, or re-attach to the ones there.

        Raises ValueError naming the field when existing files were made for
        another config, RuntimeError when another process has the store open.
        Dirty stripes (a crash mid-mutation) are rebuilt from `keys`.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(directory / "store.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if we die
        except BlockingIOError:
            os.close(lock_fd)
            raise RuntimeError(f"embedding store {directory} is already open (another process or handle)") from None
        try:
            layout = _Layout(config)
            maps = cls._attach(directory, layout)
            if maps is None:
                maps = cls._create(directory, layout)
            store = cls(directory, layout, maps, lock_fd)
        except BaseException:
            os.close(lock_fd)
            raise
        try:
            store._recover()
        except BaseException:
            store.close()
            raise
        return store

    @staticmethod
    def _nbytes(layout: _Layout, name: str) -> int:
        dtype = np.int64 if name == "header" else _DATA_FILES[name]
        return int(np.prod(layout.shape(name))) * np.dtype(dtype).itemsize

    @classmethod
    def _attach(cls, directory: Path, layout: _Layout) -> dict[str, mmap.mmap] | None:
        """Maps of existing, matching files; None when there is no complete store yet."""
        header_path = directory / "header.bin"
        if not header_path.exists() or header_path.stat().st_size < GLOBAL_FIELDS * 8:
            return None
        header = np.fromfile(header_path, dtype=np.int64, count=GLOBAL_FIELDS)
        if header[H_MAGIC] == 0:  # creation was interrupted before the header was sealed
            _log.warning("store creation was interrupted; recreating", directory=str(directory))
            return None
        if header[H_MAGIC] != MAGIC:
            raise ValueError(f"{header_path} is not an embedding store header (bad magic)")
        names = {code: name for name, code in OPTIMIZER_CODES.items()}
        for pos, (what, want) in layout.expected_header().items():
            if header[pos] != want:
                have = names.get(int(header[pos]), int(header[pos])) if pos == H_OPTIMIZER else int(header[pos])
                want = layout.config.optimizer.name if pos == H_OPTIMIZER else want
                raise ValueError(f"embedding store {directory} was created with {what}={have}, "
                                 f"but the config asks for {what}={want}")
        maps: dict[str, mmap.mmap] = {}
        try:
            for name in ("header", *_DATA_FILES):
                path = directory / f"{name}.bin"
                if not path.exists():
                    raise ValueError(f"embedding store {directory} is missing {path.name}")
                maps[name] = _map_file(path, cls._nbytes(layout, name), create=False)
        except BaseException:
            for mm in maps.values():
                mm.close()
            raise
        return maps

    @classmethod
    def _create(cls, directory: Path, layout: _Layout) -> dict[str, mmap.mmap]:
        """New empty files; the header's magic is written last, sealing a complete store."""
        maps = {name: _map_file(directory / f"{name}.bin", cls._nbytes(layout, name), create=True)
                for name in (*_DATA_FILES, "header")}
        np.frombuffer(maps["keys"], dtype=np.uint64)[:] = K.EMPTY_KEY
        np.frombuffer(maps["index"], dtype=np.int32)[:] = -1
        header = np.frombuffer(maps["header"], dtype=np.int64)
        for s in range(layout.config.num_stripes):
            row = header[GLOBAL_FIELDS + s * K.STRIPE_FIELDS:]
            row[K.F_HEAD] = row[K.F_TAIL] = -1
        for pos, (_, value) in layout.expected_header().items():
            header[pos] = value
        for name in _DATA_FILES:
            maps[name].flush()
        header[H_MAGIC] = MAGIC
        maps["header"].flush()
        _log.info("created embedding store", directory=str(directory), dim=layout.config.dim,
                  capacity=layout.config.capacity)
        return maps

    def _recover(self) -> None:
        for s, (index, keys, prev, nxt, values, hdr) in enumerate(self._stripes):
            if hdr[K.F_DIRTY]:
                rows = K.rebuild_stripe(s, self.config.num_stripes, index, keys, prev, nxt, values, hdr)
                hdr[K.F_REBUILDS] += 1
                hdr[K.F_DIRTY] = 0
                _log.warning("rebuilt dirty stripe from keys", directory=str(self.directory), stripe=s, rows=rows)

    def flush(self) -> None:
        """msync every file (matters when the directory is on disk rather than tmpfs)."""
        for mm in self._maps.values():
            mm.flush()

    def close(self) -> None:
        """Flush and unmap. The caller must have stopped using the store from other threads."""
        if not self._maps:
            return
        self.flush()
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
        hdr = self._stripes[s][5]
        if mutates:
            hdr[K.F_DIRTY] = 1
        result = fn(s, bounds[s], bounds[s + 1])
        if mutates:  # left set if fn raised: the next open rebuilds the stripe
            hdr[K.F_DIRTY] = 0
        return result or 0

    def _next_serial(self, s: int) -> int:
        """A new call number for stripe s (caller holds its lock); stamps restart before uint32 wraps."""
        serial = self._serials[s] + 1
        if serial >= 2**32:
            self._stamps[s][:] = 0
            serial = 1
        self._serials[s] = serial
        return serial

    def lookup(self, ids: np.ndarray, *, train: bool, out: np.ndarray | None = None) -> np.ndarray:
        """Rows (n, dim) float32 of `ids` (1-D uint64, duplicates allowed).

        train=True: hits move to the LRU head; a new ID is admitted with
        `admit_probability` (else it reads zeros and counts as an admission
        drop), initialised from (seed, id), evicting the stripe's least recently
        used row when full. train=False: read-only, absent IDs read zeros.
        """
        ids = _as_ids(ids, "ids")
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
        init = (self._init_key, c.init_distribution == "normal", c.init_scale,
                c.optimizer.initial_accumulator_value, c.optimizer.accumulator_width(c.dim))

        def run(s: int, lo: int, hi: int) -> int:
            K.lookup_stripe(ids, perm, lo, hi, slots, out, *self._stripes[s], self._stamps[s], self._next_serial(s),
                            bool(train), self._admit_threshold, self._admit_key, *init)
            return 0

        self._run_stripes(offsets, run, mutates=bool(train))
        return out

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply one optimizer step per row; returns rows applied (absent IDs are skipped and counted).

        `ids` should be unique (the embedding worker aggregates gradients per
        ID); a repeated ID simply gets two steps, in order.
        """
        ids = _as_ids(ids, "ids")
        n, dim = ids.shape[0], self.config.dim
        if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.shape != (n, dim):
            desc = f"{grads.dtype} {grads.shape}" if isinstance(grads, np.ndarray) else type(grads).__name__
            raise ValueError(f"grads must be a float32 array of shape {(n, dim)} matching ids, got {desc}")
        grads = np.require(grads, requirements=["C", "W"])
        perm, slots = self._buffers(n)
        offsets = K.partition(ids, self.config.num_stripes, perm)
        code, hp = self.config.optimizer.code, self._hp

        def run(s: int, lo: int, hi: int) -> int:
            index, keys, _, _, values, hdr = self._stripes[s]
            K.resolve_stripe(ids, perm, lo, hi, slots, index, keys)
            applied = O.apply_stripe(perm, lo, hi, slots, grads, values, code, hp, dim)
            hdr[K.F_MISSING_UPDATES] += hi - lo - applied
            return applied

        return self._run_stripes(offsets, run, mutates=True)

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
        keys_out, values_out = [], []
        with self._all_locks():
            for _, keys, prev, _, values, hdr in self._stripes:
                order = np.empty(int(hdr[K.F_USED]), np.int64)
                order = order[:K.lru_order(prev, hdr, order)]
                keys_out.append(keys[order])
                values_out.append(values[order])
        return np.concatenate(keys_out), np.concatenate(values_out)

    def load_rows(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Insert rows verbatim (checkpoint restore); present keys are overwritten; a full stripe evicts."""
        keys = _as_ids(keys, "keys")
        shape = (keys.shape[0], self.config.row_width)
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != shape:
            desc = f"{values.dtype} {values.shape}" if isinstance(values, np.ndarray) else type(values).__name__
            raise ValueError(f"values must be float32 of shape {shape} (dim + optimizer state), got {desc}")
        if np.any(keys == K.EMPTY_KEY):
            raise ValueError(f"key {int(K.EMPTY_KEY):#x} is reserved for empty slots and cannot be stored")
        values = np.require(values, requirements=["C", "W"])
        perm = np.empty(keys.shape[0], np.int32)
        offsets = K.partition(keys, self.config.num_stripes, perm)

        def run(s: int, lo: int, hi: int) -> int:
            K.load_stripe(keys, values, perm, lo, hi, *self._stripes[s])
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
        return sum(self._nbytes(self._layout, name) for name in ("header", *_DATA_FILES))

    @property
    def num_rows(self) -> int:
        """Live rows (no lock: a snapshot)."""
        return sum(int(hdr[K.F_USED]) for *_, hdr in self._stripes)

    def stats(self) -> dict:
        """Counters summed over stripes (read without locks: a snapshot, not a transaction)."""
        rows = np.stack([hdr for *_, hdr in self._stripes]).sum(axis=0)
        used = [int(hdr[K.F_USED]) for *_, hdr in self._stripes]
        return {
            "rows": int(rows[K.F_USED]), "capacity": self.config.capacity, "dim": self.config.dim,
            "state_width": self.config.optimizer.state_width(self.config.dim),
            "optimizer": self.config.optimizer.name, "num_stripes": self.config.num_stripes,
            "evictions": int(rows[K.F_EVICTIONS]), "inserts": int(rows[K.F_INSERTS]),
            "admission_drops": int(rows[K.F_ADMISSION_DROPS]), "missing_updates": int(rows[K.F_MISSING_UPDATES]),
            "read_misses": int(rows[K.F_READ_MISSES]), "rebuilds": int(rows[K.F_REBUILDS]),
            "index_stale_entries": int(rows[K.F_STALE]),
            "stripe_rows_min": min(used), "stripe_rows_max": max(used), "shm_bytes": self.shm_bytes,
        }


def planned_shm_bytes(config: StoreConfig) -> dict[str, int]:
    """Bytes of each file a store of `config` allocates under its shm directory (the capacity planner's source)."""
    layout = _Layout(config)
    return {name: EmbeddingStore._nbytes(layout, name) for name in ("header", *_DATA_FILES)}
