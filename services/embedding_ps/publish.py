"""On the embedding PS: this shard's part of a published model version (docs/serving.md#live-versions).

`ChangeLog` remembers which IDs changed since the last publish: the Update
path (and training lookups, which admit new rows) append each request's IDs
per width after applying it — a list append, nothing more; duplicates are
removed at publish time (and whenever the log grows large). `publish_shard`
writes either every row (a full snapshot, read under the stripe locks like a
checkpoint dump) or the logged IDs' rows, read without admitting or
refreshing anything, as sorted keys + rows .npy files into the version's
directory. Only the embedding part of each row is written, no optimizer state.

The log is swapped for an empty one before rows are read: an update applied
while the files are written may or may not be in them, and is in the next
delta either way. An ID logged but evicted by the time of the publish is left
out (a follower keeps its older row until the next full snapshot).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridrec.core.runtime import log
from hybridrec.core.layouts.bundle import FileEntry
from hybridrec.core.layouts.versions import write_table
from services.embedding_ps.store import EmbeddingStore

_log = log.get(__name__)
COMPACT_AT = 4_000_000  # logged IDs per width before they are deduplicated in place


class ChangeLog:
    """IDs per width changed since the last publish. Used from the event loop only (no lock)."""

    def __init__(self, dims: list[int]):
        self._parts: dict[int, list[np.ndarray]] = {d: [] for d in dims}
        self._sizes = {d: 0 for d in dims}
        self._limits = {d: COMPACT_AT for d in dims}  # dedup again when the log doubles past its unique size

    def add(self, dim: int, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        self._parts[dim].append(np.array(ids, dtype=np.uint64, copy=True))  # the request buffer is not kept
        self._sizes[dim] += ids.size
        if self._sizes[dim] > self._limits[dim] and len(self._parts[dim]) > 1:
            unique = np.unique(np.concatenate(self._parts[dim]))
            self._parts[dim], self._sizes[dim] = [unique], unique.size
            self._limits[dim] = max(COMPACT_AT, 2 * unique.size)

    def pending(self) -> int:
        """IDs logged (with duplicates)."""
        return sum(self._sizes.values())

    def take(self) -> dict[int, np.ndarray]:
        """The sorted unique IDs per width changed since the last take; the log starts empty again."""
        parts, self._parts = self._parts, {d: [] for d in self._parts}
        self._sizes = {d: 0 for d in self._parts}
        self._limits = {d: COMPACT_AT for d in self._parts}
        return {d: np.unique(np.concatenate(p)) if p else np.zeros(0, np.uint64) for d, p in parts.items()}


def publish_shard(stores: dict[int, EmbeddingStore], version_path: Path, *, shard: int, num_shards: int,
                  changed: dict[int, np.ndarray] | None) -> tuple[dict[str, FileEntry], dict[int, int]]:
    """Write this shard's tables of every width into `version_path`; (file entries, rows per width).

    changed None: a full snapshot (every live row); else the rows of these IDs
    that are present. On a PS request thread.
    """
    files: dict[str, FileEntry] = {}
    rows_by_dim: dict[int, int] = {}
    for dim, store in sorted(stores.items()):
        if changed is None:
            keys, values = store.items()
            rows = values[:, :dim]
        else:
            ids = changed.get(dim, np.zeros(0, np.uint64))
            rows, found = store.peek(ids)
            keys, rows = ids[found], rows[found]
        files.update(write_table(version_path, shard, num_shards, dim, keys, rows))
        rows_by_dim[dim] = int(keys.shape[0])
    _log.info("version_shard_written", directory=str(version_path), full=changed is None, rows=rows_by_dim)
    return files, rows_by_dim
