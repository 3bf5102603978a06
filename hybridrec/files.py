"""Files other processes read while they are being replaced: written whole or not at all."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any, *, fsync: bool = False) -> None:
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
        json.dump(data, f, indent=2)
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
