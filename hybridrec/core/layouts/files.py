"""Files shared between processes: written whole or not at all, and directories with one owner at a time."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any, *, fsync: bool = False, indent: int | None = 2) -> None:
    """Write `data` as indented JSON to `path` through a temporary file and a rename.

    Readers (a dashboard polling services.json, a resuming job reading a
    checkpoint manifest) see the old file or the new one, never half of one.
    With `fsync` the bytes reach the disk before the rename, so a crash cannot
    leave a renamed but empty file: what marks a checkpoint complete needs it.
    The parent directory must exist.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=indent, separators=None if indent else (",", ":")))  # C encoder: no indent
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class HashingWriter:
    """A write-only file wrapper that hashes (sha256) and counts what goes through it.

    `np.lib.format.write_array` writes through it, so an array's file and its
    checksum come from one pass over the bytes (checkpoints, published versions).
    """

    def __init__(self, f) -> None:
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        return self.f.write(data)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory: the names created or renamed in it survive a crash (a file's own fsync does not
    cover its directory entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_directory(directory: str | Path, *, what: str) -> int:
    """Create `directory` if needed and take its exclusive lock (`store.lock`); returns the lock's fd.

    Files a restarted process re-attaches to (a PS shard's store, an embedding
    worker's buffer) must have one owner at a time. flock, not a pid file: the
    kernel releases it when the owner dies, kill -9 included, so a restart
    never waits for a stale lock. Close the fd to release it. Raises
    RuntimeError naming `what` when another process (or handle) holds it.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(directory / "store.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise RuntimeError(f"{what} {directory} is already open (another process or handle)") from None
    return lock_fd
