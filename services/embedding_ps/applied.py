"""Which updates a PS shard has applied, by update id: a re-sent `PSUpdate` is acknowledged, not applied twice.

On the embedding PS. An embedding worker re-sends a batch's update when it
restarted in the middle of a push (its NN worker pushes again) or when a
shard restarted before answering; the shards that had applied it must not
apply it again. Every `PSUpdate` carries the batch's update id
(`hybridrec.core.wire.frames.update_id`); the shard records each id it applied in a
ring in its shm directory, next to its stores, so the record survives kill -9
of the PS like the rows do (docs/architecture.md#crash-rules):

```
<ps.shm_dir>/shard-00001/applied/
    store.lock    flock: one process at a time
    ring.bin      uint64: magic, layout version, window, records written, re-sends deduplicated
                  (all processes of this life), the shard's life, records inherited from a replica,
                  then `window` slots: the ids of the most recent updates (0: empty)
```

Window: the last WINDOW ids are remembered, so a re-send is recognised while
fewer than WINDOW other updates have reached the shard since the original.
A re-send follows its original by at most an embedding worker's restart and
the NN worker's retry backoff (a few seconds, and at most `cluster.retry_s`);
in that time the updates that can reach a shard are bounded by what is in
flight (each rank has at most `training.staleness` + 1 unacknowledged pushes,
and a rank waiting for a batch of the restarting worker stops) plus the
shard's update rate over those seconds. 65,536 is two orders of magnitude
above the in-flight bound of any cluster this runs and covers about a minute
at a thousand updates per second per shard.

Order: the rows first, then the record. A crash between the two leaves an
applied update unrecorded, so its re-send applies it again (at least once),
the side the store's crash rules already take for an update in flight; the
other order could record an update whose rows never changed and silently
drop its re-send. The record itself reserves its slot (bumps the count)
before writing the id there, so a torn record loses that one id, never an
older one.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from hybridrec.core.layouts import files
from hybridrec.core.runtime import log

_log = log.get(__name__)

MAGIC = int.from_bytes(b"HYRECAP\x01", "little")
LAYOUT_VERSION = 1
H_MAGIC, H_VERSION, H_WINDOW, H_WRITTEN, H_DEDUPLICATED, H_LIFE, H_INHERITED = range(7)
HEADER_WORDS = 8
WINDOW = 1 << 16
"""Update ids remembered per shard (see the module docstring for why this many)."""


class AppliedLog:
    """The ids of a shard's most recent updates, on file; membership answered from an in-memory index.

    Single-threaded: the PS servicer calls it from its event loop.
    """

    def __init__(self, directory: Path, ring_map: mmap.mmap, lock_fd: int, *, created: bool = False):
        self.directory = directory
        self.created = created
        """True when this open made the record: the shard's files were not there (a first start, or a lost
        store)."""
        self._map = ring_map
        words = np.frombuffer(ring_map, dtype=np.uint64)
        self._header, self._ring = words[:HEADER_WORDS], words[HEADER_WORDS:]
        self._lock_fd = lock_fd
        # id -> its slot; rebuilt from the ring on open (tens of milliseconds for a full window).
        self._slot_of = {int(uid): slot for slot, uid in enumerate(self._ring.tolist()) if uid}
        self.deduplicated = int(self._header[H_DEDUPLICATED])
        if not int(self._header[H_LIFE]):  # a new record, or one written before lives were kept
            self._header[H_LIFE] = np.uint64(int.from_bytes(os.urandom(8), "little") | 1)
        self.life = int(self._header[H_LIFE])
        """The shard's life: drawn when its files were created, the same across restarts of the process
        (services/embedding_ps/lives.py)."""

    @property
    def applied(self) -> int:
        """Updates this life has applied (recorded), all processes of it; ids it inherited do not count."""
        return int(self._header[H_WRITTEN]) - int(self._header[H_INHERITED])

    def recent(self) -> np.ndarray:
        """The remembered ids, oldest first (a copy): what a replica of the shard must know to answer
        re-sends the way the shard would."""
        written = int(self._header[H_WRITTEN])
        start = written % WINDOW if written >= WINDOW else 0
        ring = np.concatenate([self._ring[start:], self._ring[:start]]) if written >= WINDOW else \
            self._ring[:written].copy()
        return ring[ring != 0]

    def inherit(self, uids: np.ndarray) -> None:
        """Remember ids another copy of the shard applied (a restore from its replica), oldest first, so
        their re-sends are answered without applying them again; `applied` does not count them."""
        for uid in np.asarray(uids, np.uint64)[-WINDOW:].tolist():
            if uid and uid not in self._slot_of:
                self.record(uid)
                self._header[H_INHERITED] = np.uint64(int(self._header[H_INHERITED]) + 1)

    @classmethod
    def open(cls, directory: str | Path) -> "AppliedLog":
        """Re-attach to the record in `directory`, or create an empty one. ValueError when the file there
        was written with another layout or window; RuntimeError when another process has it open."""
        directory = Path(directory)
        lock_fd = files.lock_directory(directory, what="applied-update record")
        try:
            ring_map = _attach(directory)
            if ring_map is not None:
                return cls(directory, ring_map, lock_fd)
            return cls(directory, _create(directory), lock_fd, created=True)
        except BaseException:
            os.close(lock_fd)
            raise

    def __contains__(self, uid: int) -> bool:
        return uid in self._slot_of

    def record(self, uid: int) -> None:
        """Remember that this shard applied update `uid` (call after its rows changed)."""
        written = int(self._header[H_WRITTEN])
        slot = written % WINDOW
        self._header[H_WRITTEN] = np.uint64(written + 1)  # reserve the slot first: see the module docstring
        old = int(self._ring[slot])
        if old and self._slot_of.get(old) == slot:
            del self._slot_of[old]
        self._ring[slot] = np.uint64(uid)
        self._slot_of[uid] = slot

    def count_duplicate(self) -> None:
        """Count a re-send answered without applying it (kept across restarts, like the record)."""
        self.deduplicated += 1
        self._header[H_DEDUPLICATED] = np.uint64(self.deduplicated)

    def close(self) -> None:
        self._header = self._ring = None
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the map goes when it does
            pass
        os.close(self._lock_fd)


def _nbytes() -> int:
    return (HEADER_WORDS + WINDOW) * 8


def _attach(directory: Path) -> mmap.mmap | None:
    path = directory / "ring.bin"
    if not path.exists() or path.stat().st_size < HEADER_WORDS * 8:
        return None
    header = np.fromfile(path, dtype=np.uint64, count=HEADER_WORDS)
    if header[H_MAGIC] == 0:
        _log.warning("applied-update record creation was interrupted; recreating", directory=str(directory))
        return None
    if header[H_MAGIC] != MAGIC:
        raise ValueError(f"{path} is not an applied-update record (bad magic)")
    for pos, what, want in ((H_VERSION, "layout version", LAYOUT_VERSION), (H_WINDOW, "window", WINDOW)):
        if int(header[pos]) != want:
            raise ValueError(f"applied-update record {directory} was written with {what} {int(header[pos])}, "
                             f"this PS uses {want}: remove the directory (re-sends of updates applied before "
                             f"it was removed would then be applied again)")
    if path.stat().st_size != _nbytes():
        raise ValueError(f"{path} has {path.stat().st_size} bytes, expected {_nbytes()} (truncated or foreign file)")
    return _map(path, create=False)


def _create(directory: Path) -> mmap.mmap:
    """An empty record; the magic is written last, sealing it."""
    ring_map = _map(directory / "ring.bin", create=True)
    header = np.frombuffer(ring_map, dtype=np.uint64, count=HEADER_WORDS)
    header[H_VERSION], header[H_WINDOW] = LAYOUT_VERSION, WINDOW
    ring_map.flush()
    header[H_MAGIC] = MAGIC
    ring_map.flush()
    del header
    return ring_map


def _map(path: Path, *, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, _nbytes())
        return mmap.mmap(fd, _nbytes(), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
