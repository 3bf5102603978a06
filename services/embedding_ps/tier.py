"""A store's disk tier: every row its memory evicted, in a file on disk (docs/architecture.md#disk-tier).

On the embedding PS, under an `EmbeddingStore` whose config sets `ps.tier`.
The store's memory (its files under /dev/shm) becomes the cache of the rows:
a row it evicts is written here, and a lookup of an ID not in memory reads its
row from here before it would initialise it afresh. So a table larger than the
PS's memory forgets nothing, and `ps.capacity` only decides how much of it is
served at memory speed.

Design (measured on this project's machines; docs/benchmarks.md#disk-tier):
the tier is the store's own file, `records.bin`, mapped MAP_SHARED on a disk,
with the kernel's page cache as the cache between memory and disk. It is an
open-addressing hash table of 4 KiB pages: a key's home page is a hash of it,
a page holds `per_page` records (keys first, then rows; see kernels._tier_find)
and a full page sends a key to the next. One lookup of a row not in memory is
then one page read. A random page fault reads 128 KiB around it (readahead)
and costs ~1 ms, so the mapping is advised MADV_RANDOM, and before a lookup
takes its rows the store asks the kernel for all their pages at once
(kernels.advise_pages: posix_fadvise WILLNEED, without the GIL): the
reads then run in parallel, ~13 us a page instead of ~60. The mapping is
read-only: an evicted row is written with pwrite into its page (read in by
the same advice), so the page cache holds it at once and the kernel writes
dirty pages back to disk in the background, in batches, off the lookup path.
Writing through a shared mapping instead made every writeback write-protect
the page again, with a TLB shootdown across the cores: in a store benchmark
those interrupts took a quarter of both cores' samples, and pwrite also turns
a full disk into an error instead of a SIGBUS. The kernels call pwrite and
posix_fadvise by symbol (numba ExternalFunction), so they stay cached.

RocksDB (`rocksdict`) and LMDB were the alternatives (benchmarks/tier_stores.py):
both take one Python object per key and per value at their API, so a batch
is built and split in Python, and reading a row from the page cache cost
7-9x the tier's kernels. Records are never deleted (an ID on disk keeps its
record; the newer row in memory shadows it), so no tombstones are needed.

Files in the tier's directory: `tier.json` (what the tier was made for;
refused at open when the config asks for another), `header.bin` (int64
counters per stripe, kernels.TF_*), `records.bin` (the pages; stripe s owns an
equal run of them, guarded by its memory stripe's lock). A SIGKILLed PS loses
nothing here: its writes are in the page cache, which the kernel writes back.
A lost host loses the tier with the memory: the shard restores from its
checkpoints, which cover both tiers (services/embedding_ps/checkpoint.py).
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hybridrec.core.runtime import log
from services.embedding_ps import kernels as K

_log = log.get(__name__)

PAGE_BYTES = K.PAGE_BYTES
LOAD = 0.85
"""Records in use per record of the file at full capacity: a probe then rarely leaves its home page."""
MAGIC = "hybridrec-disk-tier"
VERSION = 1


class CorruptTier(ValueError):
    """A disk tier whose files cannot be trusted (unreadable description, wrong sizes): the shard restores."""


@dataclass(frozen=True)
class TierLayout:
    """What a tier's files hold; recorded in tier.json and compared on open."""

    dim: int
    row_width: int
    optimizer: str
    num_stripes: int
    capacity: int
    per_page: int
    pages_per_stripe: int

    @classmethod
    def of(cls, config) -> "TierLayout":
        """The layout `config` (a StoreConfig with ps.tier set) asks for."""
        width, stripes = config.row_width, config.num_stripes
        per_page = PAGE_BYTES // record_bytes(width)
        if per_page < 1:
            raise ValueError(f"ps.tier: a row of {width} float32 values does not fit a {PAGE_BYTES}-byte page")
        limit = _stripe_limit(config.ps.tier.capacity, stripes)
        return cls(dim=config.dim, row_width=width, optimizer=config.optimizer.name.value, num_stripes=stripes,
                   capacity=config.ps.tier.capacity, per_page=per_page,
                   pages_per_stripe=max(1, -(-int(limit / LOAD) // per_page)))

    @property
    def limit_per_stripe(self) -> int:
        """Records a stripe's region may hold: its share of the capacity (the rest of its pages keep probes
        short)."""
        return _stripe_limit(self.capacity, self.num_stripes)

    @property
    def pages(self) -> int:
        return self.pages_per_stripe * self.num_stripes

    @property
    def records(self) -> int:
        """Record places in the file (each with a change mark in process memory)."""
        return self.pages * self.per_page

    @property
    def nbytes(self) -> int:
        """Bytes of records.bin (sparse on creation; all of them in use at full capacity)."""
        return self.pages * PAGE_BYTES


def _stripe_limit(capacity: int, stripes: int) -> int:
    return -(-capacity // stripes)


def record_bytes(row_width: int) -> int:
    """Bytes of one record: its key and its row (embedding and optimizer state)."""
    return 8 + 4 * row_width


def planned_bytes(config) -> int:
    """Disk bytes a store of `config` takes at its tier's full capacity (0 without a tier)."""
    return TierLayout.of(config).nbytes if config.ps.tier is not None else 0


def planned_marks(config) -> int:
    """Process memory of a store's tier: one change mark per record (0 without a tier)."""
    if config.ps.tier is None:
        return 0
    return TierLayout.of(config).records


class DiskTier:
    """The disk tier of one store: its mapped pages and counters, handed to the kernels per stripe (`region`)."""

    def __init__(self, directory: Path, layout: TierLayout, fd: int, rows: mmap.mmap, header: mmap.mmap) -> None:
        self.directory, self.layout = directory, layout
        self._fd, self._rows, self._header = fd, rows, header
        pps, per_page = layout.pages_per_stripe, layout.per_page
        keys = np.frombuffer(rows, np.uint64).reshape(layout.pages, PAGE_BYTES // 8)
        vals = np.frombuffer(rows, np.float32).reshape(layout.pages, PAGE_BYTES // 4)
        self.counters = np.frombuffer(header, np.int64).reshape(layout.num_stripes, K.TIER_FIELDS)
        # Per record: 1 when it changed since a checkpoint copied it (process memory, like the store's marks).
        marks = np.zeros(layout.records, np.uint8)
        self._regions = [(keys[s * pps:(s + 1) * pps], vals[s * pps:(s + 1) * pps], self.counters[s],
                          marks[s * pps * per_page:(s + 1) * pps * per_page], np.int64(per_page), np.int32(fd),
                          np.int64(s * pps), np.zeros(1, np.uint64))
                         for s in range(layout.num_stripes)]

    # ------------------------------------------------------------ open / close
    @classmethod
    def open(cls, directory: str | Path, config, *, fresh: bool) -> "DiskTier":
        """Re-attach the tier in `directory`, or create it. `fresh`: the store's memory was created just now,
        so an old tier there belongs to a store that is gone and is removed first (its rows are older than the
        memory rows lost with it: a shard that lost its memory restores from its checkpoints instead).

        Raises ValueError naming the difference when the tier was made for another table, or the path and
        bytes when its filesystem has no room; CorruptTier when its files cannot be trusted."""
        directory = Path(directory)
        layout = TierLayout.of(config)
        if fresh and directory.exists():
            _log.warning("removing a disk tier whose store's memory is gone", directory=str(directory))
            shutil.rmtree(directory)
        directory.mkdir(parents=True, exist_ok=True)
        described = directory / "tier.json"
        if described.exists():
            _check(described, layout)
            return cls._map(directory, layout, create=False)
        if not fresh:  # the memory it was made with is here, with the rows it evicted gone
            raise CorruptTier(f"disk tier {directory} is missing (or was never completed) under a store that "
                              f"has one: the rows it held are gone")
        _check_room(directory, layout)
        return cls._map(directory, layout, create=True)

    @classmethod
    def _map(cls, directory: Path, layout: TierLayout, *, create: bool) -> "DiskTier":
        rows_path, header_path = directory / "records.bin", directory / "header.bin"
        header_bytes = layout.num_stripes * K.TIER_FIELDS * 8
        if create:
            for path, size in ((rows_path, layout.nbytes), (header_path, header_bytes)):
                with open(path, "wb") as f:
                    f.truncate(size)  # sparse: pages take disk space as rows are written to them
        else:
            for path, size in ((rows_path, layout.nbytes), (header_path, header_bytes)):
                have = path.stat().st_size if path.exists() else None
                if have != size:
                    raise CorruptTier(f"disk tier {directory}: {path.name} has {have} bytes, expected {size}")
        fd = os.open(rows_path, os.O_RDWR)
        try:
            # read-only: rows are written with pwrite (kernels._tier_write says why)
            rows = mmap.mmap(fd, layout.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            rows.madvise(mmap.MADV_RANDOM)  # a fault reads its page, not 128 KiB around it
            with open(header_path, "r+b") as f:
                header = mmap.mmap(f.fileno(), header_bytes)
        except BaseException:
            os.close(fd)
            raise
        tier = cls(directory, layout, fd, rows, header)
        if create:
            tier.counters[:, K.TF_LIMIT] = layout.limit_per_stripe
            header.flush()
            tmp = directory / "tier.json.tmp"
            tmp.write_text(json.dumps({"magic": MAGIC, "version": VERSION, **asdict(layout)}, indent=1))
            os.replace(tmp, directory / "tier.json")  # written last: a tier without it is not one yet
            _log.info("created disk tier", directory=str(directory), capacity=layout.capacity,
                      bytes=layout.nbytes)
        elif np.any(tier.counters[:, K.TF_ROWS] > tier.counters[:, K.TF_LIMIT]) or np.any(tier.counters < 0):
            tier.close()
            raise CorruptTier(f"disk tier {directory}: header.bin counters are out of range")
        return tier

    def flush(self) -> None:
        """Write the records (written with pwrite, through the file) and the counters to disk."""
        os.fsync(self._fd)
        self._header.flush()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._regions = []
        self.counters = None
        for mm in (self._rows, self._header):
            try:
                mm.close()
            except BufferError:  # a caller still holds a view
                pass
        os.close(self._fd)
        self._fd = -1

    # ------------------------------------------------------------ request path
    def region(self, s: int) -> tuple:
        """Stripe s's part of the tier, as the kernels take it (kernels._tier_find)."""
        return self._regions[s]

    def check_writes(self, s: int, before: int) -> None:
        """Raise OSError when a write to stripe s's region failed since its counter read `before` (a full disk,
        an I/O error): the rows it held are lost, and the call that lost them must not be acknowledged."""
        failed = int(self.counters[s, K.TF_WRITE_ERRORS]) - before
        if failed:
            raise OSError(f"disk tier {self.directory}: {failed} write(s) failed (disk full or I/O error); "
                          f"the rows they held are lost")

    def stats(self) -> dict:
        """Counters summed over stripes (read without locks) and sizes."""
        c = self.counters.sum(axis=0)
        lookups = int(c[K.TF_LOOKUPS])
        disk_rows = int(c[K.TF_ROWS])
        return {"dir": str(self.directory), "capacity": self.layout.capacity, "rows": disk_rows,
                "bytes": disk_rows * record_bytes(self.layout.row_width), "file_bytes": self.layout.nbytes,
                "fills": int(c[K.TF_FILLS]), "writebacks": int(c[K.TF_WRITEBACKS]),
                "overflows": int(c[K.TF_OVERFLOWS]), "disk_updates": int(c[K.TF_DISK_UPDATES]),
                "write_errors": int(c[K.TF_WRITE_ERRORS]),
                "disk_reads": int(c[K.TF_DISK_READS]), "lookups": lookups, "misses": int(c[K.TF_MISSES]),
                "memory_hit_rate": round(1.0 - int(c[K.TF_MISSES]) / lookups, 6) if lookups else None}

    @property
    def num_rows(self) -> int:
        """Records on disk (a row in memory may have an older one here)."""
        return int(self.counters[:, K.TF_ROWS].sum())


def _check(described: Path, layout: TierLayout) -> None:
    """Refuse a tier made for another table, naming the difference; CorruptTier when it cannot be read."""
    try:
        found = json.loads(described.read_text())
        if found.get("magic") != MAGIC or found.get("version") != VERSION:
            raise CorruptTier(f"disk tier {described.parent}: {described.name} is not a version-{VERSION} "
                              f"disk tier description")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptTier(f"disk tier {described.parent}: cannot read {described.name}: {exc}") from exc
    for key, want in asdict(layout).items():
        if found.get(key) != want:
            raise ValueError(f"disk tier {described.parent} was made for {key}={found.get(key)}, but the config "
                             f"asks for {key}={want} (another table: point ps.tier.dir elsewhere or remove it)")


def _check_room(directory: Path, layout: TierLayout) -> None:
    """Refuse a tier whose filesystem cannot take it at full capacity (it is sparse: the room is not taken now)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < layout.nbytes:
        raise ValueError(f"disk tier {directory} needs {layout.nbytes} bytes at ps.tier.capacity "
                         f"{layout.capacity} rows, but its filesystem has {free} bytes free")
