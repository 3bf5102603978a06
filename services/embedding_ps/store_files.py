"""The embedding store's files: its config, their layout, creating, re-attaching (docs/architecture.md#embedding-store).

On the embedding PS (and the `hybridrec plan` CLI, which sizes stores with
`planned_shm_bytes`). Split from store.py so that everything that decides
what is on disk sits in one place, apart from the request path: `EmbeddingStore`
(store.py) opens its files through `lock_directory`, `attach_files` and
`create_files` and only ever sees the mapped arrays.

Every array lives in a file under a directory (by default below /dev/shm)
mapped MAP_SHARED, so a restarted PS process re-attaches to the same memory
and an acknowledged update survives kill -9.

Files: `header.bin` (int64: global fields, then one row per stripe with its
dirty flag, LRU head/tail and counters), `index.bin` (int32 open-addressing
hash index, key -> slot plus a 7-bit hash tag, -1 empty, linear probing;
evictions leave stale entries that a periodic sweep drops, see
kernels._reindex), `keys.bin` (uint64 slot -> key, EMPTY_KEY when free),
`prev.bin`/`next.bin` (int32 array-based LRU list) and `values.bin` (float32
slot -> embedding then optimizer state). Stripe s owns slots
[bases[s], bases[s+1]) of every per-slot file and its own region of the
index (`Layout`). The embedding lifecycle adds `tables.bin` (int64 counters
per stripe and table), and only when it is used `sketch.bin` (uint8 count-min
counters, one block per stripe: a stripe's IDs are counted in its own block,
under its own lock) and `touched.bin` (int64 per slot: store clock and unix
ms of the row's last update, for TTLs). Changing any of this means bumping
LAYOUT_VERSION.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable

import numpy as np

from hybridrec.core.layouts import files
from hybridrec.core.runtime import log
from hybridrec.core.config import Config, EmbeddingOptimizerConfig, PSConfig
from services.embedding_ps import kernels as K
from services.embedding_ps.optimizers import OPTIMIZER_CODES, optimizer_code, state_width
from services.embedding_ps.row_storage import STORAGE_CODES, STORAGE_NAMES, kernel_storage, weight_words

_log = log.get(__name__)

MAGIC = int.from_bytes(b"HYRECPS\x01", "little")
LAYOUT_VERSION = 3
# Global header fields (int64), followed by num_stripes rows of kernels.STRIPE_FIELDS.
(H_MAGIC, H_VERSION, H_DIM, H_CAPACITY, H_OPTIMIZER, H_STATE_WIDTH, H_NUM_STRIPES, H_SEED, H_INDEX_SLOTS,
 H_SKETCH_COLS, H_SKETCH_DEPTH, H_TTL, H_CLOCK, H_TIER, H_STORAGE) = range(15)
# H_CLOCK: updates the store applied (`EmbeddingStore.tick`), the unit of step TTLs; survives restarts.
# H_TIER: 1 when the store has a disk tier (ps.tier): its memory is then not the whole table, and re-attaching it
# without its tier (or a tier to a store made without one) would serve a table with rows missing. Stores made
# before this field read 0 there: without a tier, as they were.
# H_STORAGE: how the weights are stored (row_storage's codes, ps.storage); stores made before it read 0: fp32.
GLOBAL_FIELDS = 16
DATA_FILES = {"index": np.int32, "keys": np.uint64, "prev": np.int32, "next": np.int32, "values": np.float32,
              "tables": np.int64, "sketch": np.uint8, "touched": np.int64}
"""Element type of each file besides the header (int64), by name: the file is `{name}.bin`."""
OPTIONAL_FILES = ("sketch", "touched")
"""Files that exist only when the lifecycle uses them (`Layout.file_names`)."""


@dataclass(frozen=True)
class StoreConfig:
    """Shape and behaviour of one store: the job's settings, as the config sections that declare them.

    `optimizer` is the config's optimizer.embedding and `ps` its ps section: capacity, num_stripes, init,
    admit_probability, weight_bound and the lifecycle (admission, TTLs, sketch), each declared, defaulted and
    validated there, once. Only what is one store's own is declared here: its `dim`, the `seed` (training.seed)
    and how the lifecycle applies to it (`groups`, `ticks_per_step`). dim, capacity, optimizer name, seed and
    num_stripes are recorded in the files and must match on re-attach (`Layout.expected_header`); the others
    (hyper-parameters included) may change between runs.

    The PS builds it from the job's config (`from_config`); tests and benchmarks build the sections they
    change: `StoreConfig(dim=4, optimizer=SGD, ps=PSConfig(capacity=64, init={"scale": 0.05}))`.
    """

    dim: int
    """Embedding width."""
    optimizer: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)
    """Optimizer applied by `update` (optimizer.embedding); decides the state stored after each row."""
    ps: PSConfig = field(default_factory=PSConfig)
    """The PS settings the store follows (`capacity`, `num_stripes`, init, admission, lifecycle)."""
    seed: int = 0
    """Seed of the deterministic initialisation and admission draws (training.seed)."""
    groups: tuple[int, ...] | None = None
    """Feature groups (tables) whose IDs the store holds, which ps.lifecycle applies to; None: every table."""
    ticks_per_step: int = 1
    """Store updates per training step (one per NN worker): ps.lifecycle.ttl_steps in the store's clock."""

    @classmethod
    def from_config(cls, config: Config, dim: int) -> "StoreConfig":
        """The store of width `dim` that the job's config asks for (on every PS shard)."""
        # One update per NN worker per training step reaches every shard: a step is that many store ticks.
        return cls(dim=dim, optimizer=config.optimizer.embedding, ps=config.ps, seed=config.training.seed,
                   groups=tuple(sorted({f.group for f in config.features if f.dim == dim})),
                   ticks_per_step=len(config.cluster.nn_workers))

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        """What the config sections cannot check: the store's own fields, and settings against its shape."""
        if not isinstance(self.optimizer, EmbeddingOptimizerConfig):
            raise ValueError("store optimizer must be an EmbeddingOptimizerConfig, "
                             f"got {type(self.optimizer).__name__}")
        if not isinstance(self.ps, PSConfig):
            raise ValueError(f"store ps must be a PSConfig, got {type(self.ps).__name__}")
        if not isinstance(self.ticks_per_step, int) or self.ticks_per_step < 1:
            raise ValueError(f"store ticks_per_step must be >= 1, got {self.ticks_per_step}")
        if self.dim < 1:
            raise ValueError(f"store dim must be >= 1, got {self.dim}")
        if self.capacity < self.num_stripes:
            raise ValueError(f"store capacity ({self.capacity}) must be >= num_stripes ({self.num_stripes})")
        if -(-self.capacity // self.num_stripes) > K.MAX_STRIPE_ROWS:
            raise ValueError(f"store capacity per stripe must be <= {K.MAX_STRIPE_ROWS}: raise num_stripes "
                             f"(capacity {self.capacity}, num_stripes {self.num_stripes})")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"store seed must be in [0, 2**63), got {self.seed}")
        if self.groups is not None and not all(0 <= g < K.NUM_TABLES for g in self.groups):
            raise ValueError(f"store groups must be in [0, {K.NUM_TABLES}), got {list(self.groups)}")
        for what, table in (("ps.lifecycle.ttl_steps x ticks_per_step", self.ttl_updates),
                            ("ps.lifecycle.ttl_s in ms", self.ttl_ms)):
            for group, value in table.items():
                if value > 2**62:
                    raise ValueError(f"store {what} of table {group} must be <= 2**62, got {value}")

    @property
    def capacity(self) -> int:
        """Rows the store holds before it evicts least recently used ones (ps.capacity)."""
        return self.ps.capacity

    @property
    def num_stripes(self) -> int:
        """Independently locked parts of the table (ps.num_stripes)."""
        return self.ps.num_stripes

    @property
    def tables(self) -> Iterable[int]:
        """The tables ps.lifecycle applies to."""
        return range(K.NUM_TABLES) if self.groups is None else self.groups

    @cached_property
    def admit_after(self) -> dict[int, int]:
        """Per table that admits only after k > 1 occurrences: k (ps.lifecycle.admit_after, per table)."""
        life = self.ps.lifecycle
        return {g: life.admit_after_of(g) for g in self.tables if life.admit_after_of(g) > 1}

    @cached_property
    def ttl_updates(self) -> dict[int, int]:
        """Per table with a step TTL: store updates (`tick`) without an update after which `expire` removes a row."""
        steps = {g: self.ps.lifecycle.ttl_of(g)[0] for g in self.tables}
        return {g: n * self.ticks_per_step for g, n in steps.items() if n is not None}

    @cached_property
    def ttl_ms(self) -> dict[int, int]:
        """Per table with a time TTL: milliseconds without an update after which `expire` removes a row."""
        seconds = {g: self.ps.lifecycle.ttl_of(g)[1] for g in self.tables}
        return {g: max(1, round(s * 1000)) for g, s in seconds.items() if s is not None}

    @property
    def uses_sketch(self) -> bool:
        """A table admits only after k > 1 occurrences: the store counts them in a sketch."""
        return bool(self.admit_after)

    @property
    def uses_ttl(self) -> bool:
        """A table's rows expire by age: the store stamps every row's last update."""
        return bool(self.ttl_updates or self.ttl_ms)

    @property
    def sketch_cols(self) -> int:
        """Sketch counters per row per stripe (0 without a sketch)."""
        return -(-self.ps.lifecycle.sketch_width // self.num_stripes) if self.uses_sketch else 0

    @property
    def sketch_depth(self) -> int:
        """Sketch rows (0 without a sketch)."""
        return self.ps.lifecycle.sketch_depth if self.uses_sketch else 0

    @property
    def stripe_window(self) -> int:
        """Occurrences a stripe counts before it halves its counters (each stripe sees 1/num_stripes of them)."""
        life = self.ps.lifecycle
        window = life.sketch_window if life.sketch_window is not None else life.sketch_width
        return max(1, window // self.num_stripes)

    @property
    def storage_code(self) -> int:
        """How the weights are stored (ps.storage), as the kernels' code (row_storage.FP32, FP16, BF16)."""
        return STORAGE_CODES[self.ps.storage]

    @property
    def kernel_storage(self) -> int | None:
        """The kernels' `storage` argument: None for float32 weights, else the 16-bit code (`kernel_storage`)."""
        return kernel_storage(self.storage_code)

    @property
    def row_width(self) -> int:
        """float32 words per row: the embedding (two weights a word when 16-bit), then the optimizer state."""
        return weight_words(self.dim, self.storage_code) + state_width(self.optimizer, self.dim)


@dataclass
class Layout:
    """Sizes derived from a config: stripe s owns slots [bases[s], bases[s+1])."""

    config: StoreConfig
    index_slots: int = 0  # per stripe, a power of two >= 2 * largest stripe (live entries <= 1/2), >= 8
    bases: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        self.bases = [s * c.capacity // c.num_stripes for s in range(c.num_stripes + 1)]
        largest = max(b - a for a, b in zip(self.bases, self.bases[1:]))
        self.index_slots = max(8, 1 << (2 * largest - 1).bit_length())

    @property
    def file_names(self) -> tuple[str, ...]:
        """The files of this store: the lifecycle's sketch and stamps only when the config uses them."""
        c = self.config
        skip = {"sketch"} if not c.uses_sketch else set()
        skip |= {"touched"} if not c.uses_ttl else set()
        return ("header", *(name for name in DATA_FILES if name not in skip))

    def shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        return {"header": (GLOBAL_FIELDS + c.num_stripes * K.STRIPE_FIELDS,),
                "index": (c.num_stripes * self.index_slots,), "values": (c.capacity, c.row_width),
                "tables": (c.num_stripes, K.NUM_TABLES, K.TABLE_FIELDS),
                "sketch": (c.num_stripes, c.sketch_depth, c.sketch_cols),
                "touched": (c.capacity if c.uses_ttl else 0, 2),
                }.get(name, (c.capacity,))

    def expected_header(self) -> dict[int, tuple[str, int]]:
        c = self.config
        return {H_VERSION: ("layout version", LAYOUT_VERSION), H_DIM: ("dim", c.dim),
                H_CAPACITY: ("capacity", c.capacity), H_OPTIMIZER: ("optimizer", optimizer_code(c.optimizer)),
                H_STATE_WIDTH: ("state width", state_width(c.optimizer, c.dim)),
                H_NUM_STRIPES: ("num_stripes", c.num_stripes), H_SEED: ("seed", c.seed),
                H_INDEX_SLOTS: ("index slots per stripe", self.index_slots),
                H_SKETCH_COLS: ("sketch columns per stripe (ps.lifecycle.sketch_width / num_stripes, 0: no sketch)",
                                c.sketch_cols),
                H_SKETCH_DEPTH: ("sketch depth (0: no sketch)", c.sketch_depth),
                H_TTL: ("row stamps for TTLs (1: a table has a TTL)", int(c.uses_ttl)),
                H_TIER: ("disk tier (1: ps.tier)", int(c.ps.tier is not None)),
                H_STORAGE: ("weight storage (ps.storage)", c.storage_code)}


def as_ids(ids: np.ndarray, what: str) -> np.ndarray:
    """`ids` as the kernels take them, or ValueError naming `what`."""
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        desc = f"{ids.dtype} array of shape {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"{what} must be a 1-D uint64 numpy array, got {desc}")
    # Contiguous and writable: read-only arrays (np.frombuffer of a request) are another numba type,
    # which would cost a second compilation on the first request; the copy is cheap next to a lookup.
    return np.require(ids, requirements=["C", "W"])


def file_dtype(name: str) -> type[np.generic]:
    """Element type of file `name` ("header" or a key of DATA_FILES)."""
    return np.int64 if name == "header" else DATA_FILES[name]


def file_nbytes(layout: Layout, name: str) -> int:
    """Size in bytes of file `name` for this layout."""
    return int(np.prod(layout.shape(name))) * np.dtype(file_dtype(name)).itemsize


def planned_shm_bytes(config: StoreConfig) -> dict[str, int]:
    """Bytes of each file a store of `config` allocates under its shm directory (the capacity planner's source)."""
    layout = Layout(config)
    return {name: file_nbytes(layout, name) for name in layout.file_names}


def lock_directory(directory: Path) -> int:
    """Create `directory` if needed and take its exclusive lock; returns the lock's fd (close it to release).

    Raises RuntimeError when another process (or handle) has the store open.
    """
    return files.lock_directory(directory, what="embedding store")


def _map_file(path: Path, nbytes: int, *, create: bool) -> mmap.mmap:
    """MAP_SHARED mapping of a file, a new one with its pages reserved (`posix_fallocate`). Not pre-faulted
    (MAP_POPULATE): that takes its time before the shard serves (1.2 s to map 15 GiB so; 0.2 s for the README
    example's 4M rows, 0.7-1.7 s with both shards at once on a cold start); `prefault` does it behind the
    first requests instead, for a new store as for a re-attached one."""
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
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range's pages in, writable, as MAP_POPULATE does at mapping time."""
PREFAULT_CHUNK = 16 << 20
"""Bytes per madvise call: how soon a prefault notices that its store closed."""


def _madvise() -> ctypes._CFuncPtr:
    """libc's madvise through ctypes, which releases the GIL during the call (mmap.madvise holds it: a thread
    faulting 15 GiB in so kept a restarting PS's event loop from reaching SERVING for 4 s)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


def prefault(maps: dict[str, mmap.mmap], directory: Path, stop: threading.Event) -> threading.Thread:
    """Fault the store files' pages in on a daemon thread, chunk by chunk, while the store serves, until
    `stop` is set (the store closing: a map held by the thread is unmapped when the thread lets go of it).
    Stops at a chunk that fails (a kernel without MADV_POPULATE_WRITE): pages then fault in as requests touch
    them, as they would have anyway."""
    def run() -> None:
        started, done, madvise = time.perf_counter(), 0, _madvise()
        for mm in list(maps.values()):
            try:
                view = (ctypes.c_char * len(mm)).from_buffer(mm)  # keeps the map mapped while it is faulted in
            except (ValueError, TypeError):  # closed already
                return
            try:
                for start in range(0, len(mm), PREFAULT_CHUNK):
                    if stop.is_set():
                        return
                    length = min(PREFAULT_CHUNK, len(mm) - start)
                    if madvise(ctypes.addressof(view) + start, length, MADV_POPULATE_WRITE) != 0:
                        _log.info("store prefault stopped", directory=str(directory), bytes=done,
                                  reason=os.strerror(ctypes.get_errno()))
                        return
                    done += length
            finally:
                del view
        _log.info("store prefaulted", directory=str(directory), bytes=done,
                  seconds=round(time.perf_counter() - started, 3))

    thread = threading.Thread(target=run, name="store-prefault", daemon=True)
    thread.start()
    return thread


def attach_files(directory: Path, layout: Layout) -> dict[str, mmap.mmap] | None:
    """Maps of existing, matching files; None when there is no complete store yet.

    Raises ValueError naming the field when the files were made for another config.
    """
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
            have = int(header[pos])
            if pos == H_OPTIMIZER:
                have, want = names.get(have, have), layout.config.optimizer.name
            elif pos == H_STORAGE:
                have, want = STORAGE_NAMES.get(have, have), STORAGE_NAMES[want]
            raise ValueError(f"embedding store {directory} was created with {what}={have}, "
                             f"but the config asks for {what}={want}")
    maps: dict[str, mmap.mmap] = {}
    try:
        for name in layout.file_names:
            path = directory / f"{name}.bin"
            if not path.exists():
                raise ValueError(f"embedding store {directory} is missing {path.name}")
            maps[name] = _map_file(path, file_nbytes(layout, name), create=False)
    except BaseException:
        for mm in maps.values():
            mm.close()
        raise
    return maps


def create_files(directory: Path, layout: Layout) -> dict[str, mmap.mmap]:
    """New empty files; the header's magic is written last, sealing a complete store."""
    maps = {name: _map_file(directory / f"{name}.bin", file_nbytes(layout, name), create=True)
            for name in (*layout.file_names[1:], "header")}
    np.frombuffer(maps["keys"], dtype=np.uint64)[:] = K.EMPTY_KEY
    np.frombuffer(maps["index"], dtype=np.int32)[:] = -1
    header = np.frombuffer(maps["header"], dtype=np.int64)
    for s in range(layout.config.num_stripes):
        row = header[GLOBAL_FIELDS + s * K.STRIPE_FIELDS:]
        row[K.F_HEAD] = row[K.F_TAIL] = -1
    for pos, (_, value) in layout.expected_header().items():
        header[pos] = value
    for name in layout.file_names[1:]:
        maps[name].flush()
    header[H_MAGIC] = MAGIC
    maps["header"].flush()
    _log.info("created embedding store", directory=str(directory), dim=layout.config.dim,
              capacity=layout.config.capacity)
    return maps
