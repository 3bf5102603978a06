"""Live model versions: the directory a training job publishes into and inference services follow.

Layout (docs/serving.md#live-versions); every version is a bundle directory (hybridrec/core/layouts/bundle.py):

    <publish.dir>/v00000001/manifest.json        written last, atomically, by NN worker rank 0:
                                                   a directory without it is incomplete and ignored
    <publish.dir>/v00000001/dense.pt              always the complete dense state_dict
    <publish.dir>/v00000001/embeddings/shard-00000-of-00002/dim16.keys.npy, dim16.rows.npy
                                                   written by PS shard 0 (`EmbeddingPS.Publish`)

A version whose manifest has `base_version: None` is a full snapshot: its
tables hold every row. Otherwise it is a delta: its tables hold the rows
changed since `base_version`, and a reader merges them onto that version's
table (`merge_tables`: copy-on-write, the old table is never touched). Rows
the PS evicted stay in a follower's table until the next full snapshot.

This module is shared by the writer (layout, `write_table`, `compact`) and the
reader (`list_versions`, `chain_to`, `Follower`); it imports no service.
"""
from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hybridrec.core.runtime import log
from hybridrec.core.layouts.files import HashingWriter
from hybridrec.core.layouts.bundle import (BundleError, BundleManifest, EmbeddingTable, FileEntry, ShardTable,
                              load_dense,
                              read_manifest, table_files, verify)

_VERSION_DIR = re.compile(r"^v(\d{8})$")
MAX_VERSION = 10**8 - 1
_log = log.get(__name__)


def version_name(version: int) -> str:
    if not 1 <= version <= MAX_VERSION:
        raise ValueError(f"model version {version} is not in [1, {MAX_VERSION}]")
    return f"v{version:08d}"


def version_dir(root: str | Path, version: int) -> Path:
    """Where version `version` lives under the versions directory `root`."""
    return Path(root) / version_name(version)


@dataclass(frozen=True)
class VersionInfo:
    """A complete version: its directory and (parsed, not yet checksum-verified) manifest."""

    version: int
    path: Path
    manifest: BundleManifest

    @property
    def full(self) -> bool:
        return self.manifest.base_version is None


def list_versions(root: str | Path) -> tuple[list[VersionInfo], dict[int, str]]:
    """Complete versions in ascending order, and why each other version directory is not one.

    A directory without a manifest is reported as incomplete ("no manifest");
    a manifest that does not parse or names another version is reported with
    the reason. Nothing is verified against checksums here (that is for loading).
    """
    root = Path(root)
    complete: list[VersionInfo] = []
    other: dict[int, str] = {}
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return [], {}
    for entry in entries:
        match = _VERSION_DIR.match(entry.name)
        if not match or not entry.is_dir():
            continue
        number = int(match[1])
        try:
            manifest = read_manifest(Path(entry.path))
        except BundleError as exc:
            other[number] = str(exc)
            continue
        if manifest.version != number:
            other[number] = f"{entry.path}/manifest.json: names version {manifest.version}, its directory {number}"
        elif manifest.base_version is not None and not 1 <= manifest.base_version < number:
            other[number] = f"{entry.path}/manifest.json: base_version {manifest.base_version} is not before it"
        else:
            complete.append(VersionInfo(number, Path(entry.path), manifest))
    return complete, other


def newest_version_number(root: str | Path) -> int:
    """The highest version number used under `root`, complete or not (0 when there is none)."""
    try:
        names = [e.name for e in os.scandir(root)]
    except FileNotFoundError:
        return 0
    return max((int(m[1]) for n in names if (m := _VERSION_DIR.match(n))), default=0)


def chain_to(versions: dict[int, VersionInfo], target: int, current: int | None = None) -> list[VersionInfo] | None:
    """What to apply to reach `target`: [full, delta, ...] or, from `current`, the deltas after it.

    Follows `base_version` links back from `target` until `current` (deltas
    only) or a full snapshot. None when a link is missing (compacted away, never
    completed, or refused).
    """
    chain: list[VersionInfo] = []
    number: int | None = target
    while True:
        if current is not None and number == current:
            break
        info = versions.get(number) if number is not None else None
        if info is None:
            return None
        chain.append(info)
        if info.full:
            break
        number = info.manifest.base_version
    chain.reverse()
    return chain


def kept_versions(versions: list[VersionInfo], keep: int) -> set[int]:
    """Versions compaction keeps: the newest full snapshot and every version after it, the newest `keep`
    versions, and every version one of those needs (its chain back to a full snapshot)."""
    if not versions:
        return set()
    by_number = {v.version: v for v in versions}
    fulls = [v.version for v in versions if v.full]
    wanted = {v.version for v in versions if fulls and v.version >= fulls[-1]}
    wanted |= {v.version for v in versions[-keep:]}
    kept: set[int] = set()
    for number in wanted:
        chain = chain_to(by_number, number)
        if chain is None:  # a delta whose base is gone is useless: kept only if it is among the newest
            kept.add(number)
        else:
            kept |= {v.version for v in chain}
    return kept


def compact(root: str | Path, keep: int) -> list[int]:
    """Delete the versions `kept_versions` does not keep, and incomplete ones older than the newest
    complete version (an abandoned publish); returns the version numbers removed."""
    versions, other = list_versions(root)
    kept = kept_versions(versions, keep)
    newest = versions[-1].version if versions else 0
    doomed = [v.version for v in versions if v.version not in kept] + [n for n in other if n < newest]
    for number in sorted(doomed):
        path = version_dir(root, number)
        trash = path.with_name(f".{path.name}.del-{uuid.uuid4().hex[:8]}")
        try:  # renamed first, so a reader never sees a half-deleted version under its name
            os.rename(path, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    return sorted(doomed)


# -- writing tables ---------------------------------------------------------------------------
def _save_npy(path: Path, array: np.ndarray) -> FileEntry:
    """Write `array` to `path` (tmp + rename), hashing as it goes."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            out = HashingWriter(f)
            np.lib.format.write_array(out, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return FileEntry(bytes=out.bytes, sha256=out.sha.hexdigest())


def write_table(version_path: Path, shard: int, num_shards: int, dim: int, keys: np.ndarray,
                rows: np.ndarray) -> dict[str, FileEntry]:
    """One shard's rows of one width into a version directory (sorted by key); the files' manifest entries."""
    keys = np.asarray(keys, dtype=np.uint64)
    rows = np.asarray(rows, dtype=np.float32)
    if rows.shape != (keys.shape[0], dim):
        raise ValueError(f"table of width {dim}: {keys.shape[0]} keys but rows of shape {rows.shape}")
    order = np.argsort(keys, kind="stable")
    entries = {}
    for rel, array in zip(table_files(shard, num_shards, dim), (keys[order], rows[order])):
        path = Path(version_path) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        entries[rel] = _save_npy(path, array)
    return entries


# -- merging ----------------------------------------------------------------------------------
class ArrayShardTable(ShardTable):
    """A shard's table held in arrays (what merging produces); looked up like a memory-mapped one."""

    def __init__(self, keys: dict[int, np.ndarray], rows: dict[int, np.ndarray]):  # noqa: D107 - no files
        self.keys, self.rows = keys, rows
        self.scales = {dim: None for dim in rows}  # float32 rows: versions are published unquantized


def merge_rows(keys: np.ndarray, rows: np.ndarray, new_keys: np.ndarray,
               new_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New sorted (keys, rows): `keys`/`rows` (sorted, unique) with `new_keys`' rows replaced or added.

    The inputs are not modified (they may be memory-mapped, read-only, or read
    by a request right now); a row present in both takes `new_rows`' values.
    O(n + m log n) when `new_keys` is sorted and unique, as a version's tables
    are; otherwise a sort of both.
    """
    if new_keys.shape[0] == 0:
        return keys, rows
    if new_keys.shape[0] > 1 and not np.all(new_keys[1:] > new_keys[:-1]):
        all_keys = np.concatenate([keys, new_keys])
        all_rows = np.concatenate([rows, new_rows])
        # Stable sort puts a key's old row before its new ones; keep the last of each run of equal keys.
        order = np.argsort(all_keys, kind="stable")
        sorted_keys = all_keys[order]
        last = np.ones(sorted_keys.shape[0], bool)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        pick = order[last]
        return all_keys[pick], all_rows[pick]
    pos = np.searchsorted(keys, new_keys)
    hit = np.zeros(new_keys.shape[0], bool)
    inside = pos < keys.shape[0]
    hit[inside] = keys[pos[inside]] == new_keys[inside]
    add = ~hit
    out_keys = np.insert(keys, pos[add], new_keys[add])  # always a new array
    out_rows = np.insert(rows, pos[add], new_rows[add], axis=0)
    if hit.any():  # a replaced row moved right by the rows inserted at or before its old index
        at = pos[hit]
        out_rows[at + np.searchsorted(pos[add], at, side="right")] = new_rows[hit]
    return out_keys, out_rows


def merge_tables(base: EmbeddingTable, delta: EmbeddingTable, widths: list[int]) -> EmbeddingTable:
    """A new table: `base` with every row of `delta` replaced or added, shard by shard. `base` is unchanged."""
    if len(base.shards) != len(delta.shards):
        raise BundleError(f"a delta of {len(delta.shards)} shards cannot apply to a table of {len(base.shards)}")
    if any(v is not None for s in (*base.shards, *delta.shards) for v in s.scales.values()):
        raise BundleError("a quantized table is served whole: versions a training job publishes are float32")
    shards = []
    for old, new in zip(base.shards, delta.shards):
        keys, rows = {}, {}
        for dim in widths:
            keys[dim], rows[dim] = merge_rows(old.keys[dim], old.rows[dim], np.asarray(new.keys[dim]),
                                              np.asarray(new.rows[dim]))
        shards.append(ArrayShardTable(keys, rows))
    return EmbeddingTable(shards)


def table_arrays(table: EmbeddingTable, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """All shards' (keys, rows) of one width, sorted by key (for comparing tables)."""
    keys = np.concatenate([np.asarray(s.keys[dim]) for s in table.shards])
    rows = np.concatenate([np.asarray(s.rows[dim]) for s in table.shards])
    order = np.argsort(keys, kind="stable")
    return keys[order], rows[order]


# -- following --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """One loaded version: what a follower serves. Immutable: a newer version is a new Snapshot."""

    version: int
    step: int
    manifest: BundleManifest
    table: EmbeddingTable
    dense_state: dict[str, Any]
    path: Path

    @property
    def published(self) -> float:
        """Unix time the version's manifest was written."""
        return self.manifest.created


def _open_verified(info: VersionInfo, check: bool) -> EmbeddingTable:
    if check:
        verify(info.path, info.manifest)
    return EmbeddingTable([ShardTable(info.path, info.manifest, s) for s in range(info.manifest.num_shards)])


@dataclass
class Follower:
    """Loads the newest complete version of a versions directory on each `poll` (synchronous: run it in a
    background thread). A version that does not verify is skipped with its reason, for good, and what was
    loaded before stays current."""

    root: Path
    check: bool = True
    """Verify every file's size and sha256 before use."""
    on_skip: Callable[[int, str], None] | None = None
    build: Callable[[Snapshot], Any] | None = None
    """Called with each loaded version before it becomes current (e.g. to build the dense module); if it
    raises, the version is skipped with the error as the reason. Its result is kept as `built`."""
    current: Snapshot | None = None
    built: Any = None
    """What `build` returned for the current version."""
    _pending_built: Any = field(default=None, repr=False)
    skipped: dict[int, str] = field(default_factory=dict)
    """Versions refused, with the reason."""
    newest_seen: int = 0
    """Newest complete version number found by the last poll."""
    behind: int = 0
    """Complete versions newer than the current one at the last poll."""
    passed_over: list[int] = field(default_factory=list)
    """Complete versions the last load went past: published between the previous current version and the
    one loaded, all found by the same poll. They were not refused; a newer one replaced them first."""

    def _skip(self, number: int, reason: str) -> None:
        if number not in self.skipped:
            self.skipped[number] = reason
            _log.warning("version_skipped", version=number, reason=reason)
            if self.on_skip is not None:
                self.on_skip(number, reason)

    def poll(self) -> Snapshot | None:
        """Load the newest version that loads; returns it (also as `current`), or None if nothing newer."""
        versions, other = list_versions(self.root)
        for number, reason in other.items():
            if "no manifest" not in reason or number < max((v.version for v in versions), default=0):
                self._skip(number, reason)  # a bad manifest, or an abandoned publish older than a complete one
        by_number = {v.version: v for v in versions if v.version not in self.skipped}
        current = self.current.version if self.current else None
        self.newest_seen = max(by_number, default=0)
        loaded = None
        for target in sorted((n for n in by_number if current is None or n > current), reverse=True):
            loaded = self._load(by_number, target)
            if loaded is not None:
                self.current = loaded
                self.built, self._pending_built = self._pending_built, None
                self.passed_over = sorted(n for n in by_number if (current is None or n > current) and n < target)
                break
        served = self.current.version if self.current else 0
        self.behind = sum(1 for n in by_number if n > served and n not in self.skipped)
        return loaded

    def _load(self, by_number: dict[int, VersionInfo], target: int) -> Snapshot | None:
        current = self.current
        chain = chain_to(by_number, target, current.version if current else None)
        if chain is None:
            base = by_number[target].manifest.base_version
            why = f"needs version {base}, which is " + (f"refused ({self.skipped[base]})" if base in self.skipped
                                                        else "not available")
            self._skip(target, why)
            return None
        table = current.table if current is not None and not chain[0].full else None
        for info in chain:
            try:
                part = _open_verified(info, self.check)
            except (BundleError, OSError, ValueError) as exc:
                if not info.path.exists():  # compacted away meanwhile: not the version's fault
                    return None
                self._skip(info.version, str(exc))
                if info.version != target:
                    self._skip(target, f"needs version {info.version}, which is refused")
                return None
            table = part if info.full else merge_tables(table, part, info.manifest.widths)
        info = by_number[target]
        try:
            dense = load_dense(info.path)
        except BundleError as exc:
            self._skip(target, str(exc))
            return None
        snapshot = Snapshot(target, info.manifest.step, info.manifest, table, dense, info.path)
        if self.build is not None:
            try:
                self._pending_built = self.build(snapshot)
            except Exception as exc:  # noqa: BLE001 - e.g. weights that do not fit the model: the version's fault
                self._skip(target, f"{info.path}: cannot build the model: {type(exc).__name__}: {exc}")
                return None
        return snapshot


def load_version(root: str | Path, version: int, *, check: bool = True) -> Snapshot:
    """Version `version` of a versions directory, built from its full snapshot and the deltas up to it
    (e.g. to serve or inspect one version); BundleError when it cannot be."""
    by_number = {v.version: v for v in list_versions(root)[0]}
    chain = chain_to(by_number, version)
    if chain is None:
        raise BundleError(f"{version_dir(root, version)}: not complete, or a version it needs is gone")
    table = None
    for info in chain:
        part = _open_verified(info, check)
        table = part if info.full else merge_tables(table, part, info.manifest.widths)
    info = by_number[version]
    return Snapshot(version, info.manifest.step, info.manifest, table, load_dense(info.path), info.path)


def version_age_s(snapshot: Snapshot | None, now: float | None = None) -> float:
    """Seconds since the served version was published (NaN when nothing is served)."""
    if snapshot is None:
        return float("nan")
    return max(0.0, (time.time() if now is None else now) - snapshot.published)
