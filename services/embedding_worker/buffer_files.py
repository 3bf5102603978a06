"""The embedding worker's batch buffer on file: a restarted worker re-attaches to it (docs/architecture.md#crash-rules).

On the embedding worker. Every batch the data loader puts is kept here, as
the `SparseBatch` frame bytes it arrived as, until it is consumed (an eval
batch looked up, a train batch's gradients applied on every PS shard), so
that kill -9 of the worker loses no batch: the restarted process re-plans
each stored batch under its original batch_ref and serves it. The directory
is `<ps.shm_dir>/embedding-worker-NNNNN/`, in tmpfs by default, like the PS's
store, and survives the process but not the machine.

```
embedding-worker-00003/
    store.lock          flock: one process at a time (released by the kernel when it dies)
    header.bin          uint64: magic, layout version, feature fingerprint, feature count, replica,
                        incarnation, nonce, next sequence number, batches recovered (all lives)
    00000000a7.batch    a buffered batch: its SparseBatch frame, named by its sequence number (hex)
    00000000a2.applied  a consumed train batch (its update is on every PS shard): an empty file
    00000000a5.served   a consumed eval batch (looked up), with its frame
    00000000a8.tmp      a put that died before its rename: never handed out, removed on open
```

A batch file is written under a temporary name and renamed, so a `.batch`
file is complete; it is renamed again when the batch is consumed. A
batch's sequence number is reserved in the header before its file is
written, so no two lives of the worker hand out the same batch_ref.
Consumed batches are remembered (the last RETIRED_KEPT of them) because the
worker may die after consuming a batch but before its answer reaches the NN
worker, which then asks again: a re-sent push of a train batch whose update
every shard applied is answered at once, a re-sent lookup of an eval batch
is served again.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from hybridrec.core.layouts import files
from hybridrec.core.runtime import log
from hybridrec.core.config import FeatureConfig
from hybridrec.core.wire.frames import INCARNATION_SHIFT, REF_SHIFT

_log = log.get(__name__)

MAGIC = int.from_bytes(b"HYRECEW\x01", "little")
LAYOUT_VERSION = 1
(H_MAGIC, H_VERSION, H_FINGERPRINT, H_FEATURES, H_REPLICA, H_INCARNATION, H_NONCE, H_NEXT_SEQ,
 H_RECOVERED) = range(9)
HEADER_WORDS = 16
LIVE, APPLIED, SERVED, PARTIAL = ".batch", ".applied", ".served", ".tmp"
MAX_SEQ = 1 << INCARNATION_SHIFT
"""Sequence numbers a buffer can hand out: the 40 low bits of a batch_ref."""
RETIRED_KEPT = 64
"""Consumed batches remembered per worker. A consumed batch's request comes again only when the worker died between
consuming it and answering; the NN worker re-sends within its retry backoff (at most 0.75 s) of the restart,
while each rank has at most `training.staleness` + 1 pushes and `training.prefetch` lookups outstanding:
far fewer than 64 other batches of this worker are consumed in between at any size this runs."""


def fingerprint(features: Sequence[FeatureConfig]) -> int:
    """A 63-bit digest of what a stored SparseBatch frame depends on: the features, in order, with their
    groups and widths. A buffer made under another feature list holds batches this worker cannot plan."""
    spec = json.dumps([[f.name, f.group, f.dim] for f in features]).encode()
    return int.from_bytes(hashlib.sha256(spec).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class StoredBatch:
    """A batch found in the buffer when it was opened."""

    seq: int
    frame: bytes


class BufferFiles:
    """One embedding worker's buffered batches on file, and the numbers its batch_refs are made of.

    The worker calls `reserve` and `write` in put, `consumed` when a batch is
    consumed; `stored` lists what a previous life left (oldest first).
    """

    def __init__(self, directory: Path, header_map: mmap.mmap, lock_fd: int, consumed: Sequence[tuple[int, str]]):
        self.directory = directory
        self._map = header_map
        self._header = np.frombuffer(header_map, dtype=np.uint64)
        self._lock_fd = lock_fd
        self._recovered = int(self._header[H_RECOVERED])  # readable after close (a last metrics scrape)
        self._consumed = dict(consumed)  # seq -> APPLIED or SERVED, oldest first

    @classmethod
    def open(cls, directory: str | Path, *, features: Sequence[FeatureConfig], replica: int) -> "BufferFiles":
        """Re-attach to the buffer in `directory`, or create an empty one.

        Raises ValueError when the directory holds a buffer of another feature
        config or another replica, RuntimeError when another process has it open.
        """
        directory = Path(directory)
        lock_fd = files.lock_directory(directory, what="embedding-worker buffer")
        try:
            header_map = _attach_header(directory, features, replica)
            if header_map is None:
                header_map = _create(directory, features, replica)
            for partial in directory.glob("*" + PARTIAL):
                partial.unlink()
            consumed = sorted((seq, suffix) for suffix in (APPLIED, SERVED) for seq in _seqs(directory, suffix))
            return cls(directory, header_map, lock_fd, consumed)
        except BaseException:
            os.close(lock_fd)
            raise

    # -- the numbers of this buffer's batch_refs ------------------------------------------
    @property
    def incarnation(self) -> int:
        """16-bit number of the buffer's life, in every batch_ref it hands out; drawn when it was created."""
        return int(self._header[H_INCARNATION])

    @property
    def nonce(self) -> int:
        """Random 64-bit number mixed into every update id (`hybridrec.core.wire.frames.update_id`)."""
        return int(self._header[H_NONCE])

    @property
    def recovered(self) -> int:
        """Batches re-attached by restarted lives of this worker, all lives together."""
        return self._recovered

    def count_recovered(self, n: int) -> None:
        self._recovered += n
        self._header[H_RECOVERED] = np.uint64(self._recovered)

    def reserve(self) -> int:
        """The next sequence number, recorded as used before any file of it exists."""
        seq = int(self._header[H_NEXT_SEQ])
        if seq >= MAX_SEQ:
            raise RuntimeError(f"embedding-worker buffer {self.directory} has handed out all {MAX_SEQ} sequence "
                               f"numbers; remove the directory to start a new incarnation")
        self._header[H_NEXT_SEQ] = np.uint64(seq + 1)
        return seq

    # -- batches ----------------------------------------------------------------------------
    def write(self, seq: int, frame: bytes) -> None:
        """Store a batch's frame under `seq`: complete under its final name, or not at all."""
        partial = self._path(seq, PARTIAL)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(partial, self._path(seq, LIVE))

    def stored(self) -> Iterator[StoredBatch]:
        """The batches buffered when the buffer was opened, oldest first."""
        for seq in sorted(_seqs(self.directory, LIVE)):
            yield StoredBatch(seq, self._path(seq, LIVE).read_bytes())

    def drop(self, seq: int) -> None:
        """Forget a stored batch that cannot be served (its file does not decode)."""
        self._path(seq, LIVE).unlink(missing_ok=True)

    def consumed(self, seq: int, *, eval_batch: bool) -> None:
        """Mark a batch consumed: a train batch whose update every shard applied (its bytes are dropped),
        or an eval batch that was looked up (its bytes are kept, to serve it once more). The oldest consumed
        batches beyond RETIRED_KEPT are forgotten."""
        if seq in self._consumed:
            return
        suffix = SERVED if eval_batch else APPLIED
        done = self._path(seq, suffix)
        try:
            os.rename(self._path(seq, LIVE), done)
        except FileNotFoundError:  # dropped meanwhile; remember it all the same
            done.touch()
        if not eval_batch:
            os.truncate(done, 0)
        self._consumed[seq] = suffix
        while len(self._consumed) > RETIRED_KEPT:
            old, old_suffix = next(iter(self._consumed.items()))
            del self._consumed[old]
            self._path(old, old_suffix).unlink(missing_ok=True)

    def was_applied(self, seq: int) -> bool:
        """Whether `seq` is a train batch whose update every PS shard acknowledged (and not yet forgotten)."""
        return self._consumed.get(seq) == APPLIED

    def served_frame(self, seq: int) -> bytes | None:
        """The frame of an eval batch already looked up; None when `seq` is no such batch (or forgotten)."""
        if self._consumed.get(seq) != SERVED:
            return None
        try:
            return self._path(seq, SERVED).read_bytes()
        except FileNotFoundError:
            return None

    def nbytes(self) -> int:
        """Bytes of every batch file (buffered and consumed ones kept)."""
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.suffix in (LIVE, SERVED))

    def close(self) -> None:
        self._header = None
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the map goes when it does
            pass
        os.close(self._lock_fd)

    def _path(self, seq: int, suffix: str) -> Path:
        return self.directory / f"{seq:010x}{suffix}"


def _seqs(directory: Path, suffix: str) -> Iterator[int]:
    for path in directory.glob("*" + suffix):
        try:
            yield int(path.stem, 16)
        except ValueError:
            _log.warning("foreign file in embedding-worker buffer", path=str(path))


def _expected(features: Sequence[FeatureConfig], replica: int) -> dict[int, tuple[str, int]]:
    return {H_VERSION: ("layout version", LAYOUT_VERSION),
            H_FINGERPRINT: ("feature fingerprint", fingerprint(features)),
            H_FEATURES: ("feature count", len(features)), H_REPLICA: ("replica", replica)}


def _attach_header(directory: Path, features: Sequence[FeatureConfig], replica: int) -> mmap.mmap | None:
    """The mapped header of the buffer in `directory`; None when there is none yet (or its creation was
    interrupted). ValueError naming the field and the directory when it was made for another config."""
    path = directory / "header.bin"
    if not path.exists() or path.stat().st_size != HEADER_WORDS * 8:
        return None
    header = np.fromfile(path, dtype=np.uint64)
    if header[H_MAGIC] == 0:
        _log.warning("embedding-worker buffer creation was interrupted; recreating", directory=str(directory))
        return None
    if header[H_MAGIC] != MAGIC:
        raise ValueError(f"{path} is not an embedding-worker buffer header (bad magic)")
    for pos, (what, want) in _expected(features, replica).items():
        if int(header[pos]) != want:
            raise ValueError(f"embedding-worker buffer {directory} was made with {what} {int(header[pos])}, but this "
                             f"worker has {what} {want}: its batches belong to another config; remove the "
                             f"directory or point ps.shm_dir elsewhere")
    return _map(path, create=False)


def _create(directory: Path, features: Sequence[FeatureConfig], replica: int) -> mmap.mmap:
    """A new, empty buffer: stray batch files of an unsealed one are removed; the magic is written last."""
    for stray in (p for suffix in (LIVE, APPLIED, SERVED) for p in directory.glob("*" + suffix)):
        stray.unlink()
    header_map = _map(directory / "header.bin", create=True)
    header = np.frombuffer(header_map, dtype=np.uint64)
    for pos, (_, value) in _expected(features, replica).items():
        header[pos] = value
    header[H_INCARNATION] = secrets.randbelow(1 << (REF_SHIFT - INCARNATION_SHIFT))
    # The nonce's top byte differs from the replica's, the top byte of every batch_ref of this worker:
    # batch_ref ^ nonce is never 0, so no update id is 0 (see hybridrec.core.wire.frames.update_id).
    header[H_NONCE] = (((replica ^ 0xFF) << REF_SHIFT) | secrets.randbits(REF_SHIFT))
    header_map.flush()
    header[H_MAGIC] = MAGIC
    header_map.flush()
    _log.info("created embedding-worker buffer", directory=str(directory), incarnation=int(header[H_INCARNATION]))
    return header_map


def _map(path: Path, *, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, HEADER_WORDS * 8)
        return mmap.mmap(fd, HEADER_WORDS * 8, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
