"""Prepared data: reading what `hybridrec data prepare` wrote. Runs in the data loader (and the CLI's checks).

A prepared directory holds the samples of Criteo TSV or Parquet files with
the IDs already hashed and the dense values already transformed, so the
loader slices batches out of memory-mapped arrays and parses nothing, in
every epoch. Layout (`prepared_write.py` writes it):

    DIR/manifest.json                 written last: versions, sources, schema, shards, file sizes and checksums
    DIR/shard-00000/labels.npy        float32 (n,), or (n, columns) with several data.labels or a weight column
    DIR/shard-00000/dense.npy         float32 (n, num_dense)
    DIR/shard-00000/ids.npy           TSV: uint64 (n, features), the configured features' columns
    DIR/shard-00000/present.npy       TSV: bool (n, features)
    DIR/shard-00000/bag{f}.values.npy   Parquet: feature f's IDs, uint64 (nnz,)
    DIR/shard-00000/bag{f}.offsets.npy  Parquet: int64 (n + 1,), sample i's IDs are values[o[i]:o[i + 1]]

One shard per source file, holding that file's good rows in order, so the
batches (`training.batch_size` rows, a file's last one smaller) are exactly
those read from the source. A `Position` in prepared data is (epoch, shard,
row, row + 1): checkpoints, the data loader's restart and eval work as with
raw files, but a position taken on raw files means nothing in prepared data.

Why .npy files and not Arrow IPC: `np.load(mmap_mode="r")` gives zero-copy
views with numpy alone, a batch's `Rows` are made from slices of them (no
schema layer or conversion between Arrow arrays and numpy), and a shard's arrays
can be written column by column while the source streams through.

What is checked before any batch is read (`open_dataset`): the manifest
parses and is of this `FORMAT_VERSION` (else: both versions, and re-run
prepare); the config's schema (`schema`: what decides the IDs and dense
values) equals the manifest's (else: the differing keys, both values);
every shard file exists with its manifest size, dtype and row count, and
its checksum matches (else: the file). The checksum is xxh3-128 (xxhash):
it runs at memory speed, so checking the ~290 MB of 1M prepared Criteo rows
takes tens of milliseconds from the page cache, and a cold read warms the
cache for the first epoch, which reads every byte anyway. A cryptographic
hash (blake2b, ~1 GB/s) would cost about 0.3 s per 1M rows at every start
and loader restart; corruption, not tampering, is what this guards against.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridrec.core.config import Config, ConfigError, FeatureKind
from hybridrec.core.layouts.criteo_format import DENSE_COLUMNS
from hybridrec.core.wire.jagged import Bag, KeyedBags
from services.dataloader.batching import Position, ReadCounters, Rows
from services.dataloader.tsv import BadLinePolicy
from services.dataloader.splits import Split, whole

FORMAT = "hybridrec-prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHECKSUM = "xxh3-128"
_CHUNK_BYTES = 16 << 20
_DENSE_TRANSFORM = {"tsv": "log1p(max(x, 0)), empty 0", "parquet": "float32 as stored, null 0"}
"""The schema's `dense_transform` of each source format's default (the text prepared data of every version so
far holds: a transform set per column is spelt out instead)."""

_log = logging.getLogger(__name__)


class PreparedDataError(ConfigError):
    """Prepared data that cannot be used as it is: the message names the file and what to do."""


class ShardFile(BaseModel):
    """One file of a prepared shard. Not a bundle's `FileEntry` (sha256): a shard's digest is `CHECKSUM`, a
    hash at memory speed, because every data loader start checks every shard file (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    bytes: int
    """File size."""
    checksum: str
    """`CHECKSUM` hex digest of the file's bytes."""


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    """Directory of the shard's files, e.g. shard-00000."""
    source: int
    """Index of its source file in `sources`."""
    rows: int
    """Good rows (samples) in the shard."""
    bad_lines: int = 0
    """Lines (TSV) or rows (Parquet) of the source the reader skipped as bad."""
    truncated_rows: int = 0
    """Parquet: rows with a list longer than its feature's max_len."""
    non_finite_rows: int = 0
    """Rows of the source skipped for a NaN or infinite dense value (`data.non_finite: skip`)."""
    files: dict[str, ShardFile]
    """Every file of the shard by name, with size and checksum."""


class SourceEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    """The source file as given to prepare (absolute)."""
    bytes: int
    """Its size when it was prepared."""
    mtime_ns: int
    """Its modification time when it was prepared."""


class Manifest(BaseModel):
    """What a prepared directory holds: written last, so a directory without it is not complete."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    format: str = FORMAT
    """Always "hybridrec-prepared"."""
    format_version: int = FORMAT_VERSION
    """Layout version; a reader refuses another."""
    hybridrec_version: str
    """The hybridrec that prepared it."""
    checksum: str = CHECKSUM
    """How the file checksums are computed."""
    fingerprint: str
    """Digest of `schema_`: equal fingerprints, equal IDs and dense values."""
    schema_: dict[str, Any] = Field(alias="schema")
    """What in the config decides the IDs and dense values (`schema`), by config key."""
    sources: list[SourceEntry]
    """The source files, in order: shard i holds source i's rows."""
    shards: list[ShardEntry]
    """One per source file."""

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)


def hybridrec_version() -> str:
    try:
        return metadata.version("hybridrec")
    except metadata.PackageNotFoundError:
        return "unknown"


def schema(config: Config) -> dict[str, Any]:
    """The config's parts that change the prepared arrays, by dotted key: the source format, the label and
    dense columns and their transform, and per feature (in order) its column, group and, for lists, max_len.
    Feature names, widths and pooling are left out: they do not change the data."""
    data = config.data
    features = []
    for f in config.features:
        entry: dict[str, Any] = {"column": f.source, "group": f.group, "kind": f.kind.value}
        if f.kind == FeatureKind.LIST:
            entry["max_len"] = f.max_len
        features.append(entry)
    dense = list(DENSE_COLUMNS) if data.format == "tsv" else list(config.dense_columns)
    transforms = config.dense_transforms
    transform = _DENSE_TRANSFORM[data.format]
    if data.format == "parquet" and any(t != "none" for t in transforms):
        transform = ", ".join(f"{c} {t}" for c, t in zip(dense, transforms)) + "; log1p(max(x, 0)), null 0"
    schema_ = {"data.format": data.format, "data.labels": data.label_names, "data.dense_columns": dense,
               "dense_transform": transform, "features": features}
    if any(not t.binary for t in data.tasks):  # only when set: the fingerprints of earlier directories hold
        schema_["data.label_kinds"] = [t.kind for t in data.tasks]
    if data.weight_column is not None:
        schema_["data.weight_column"] = data.weight_column
    return schema_


def fingerprint(schema_: dict[str, Any]) -> str:
    text = json.dumps(schema_, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def checksum(path: Path) -> str:
    """xxh3-128 of the file's bytes: a non-cryptographic hash at memory speed (see the module docstring)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def is_prepared(path: str | os.PathLike) -> bool:
    """A directory (with or without its manifest): `data.train` entries that are directories are prepared
    data; one without a manifest is refused by `open_dataset`, never read as raw files."""
    return Path(path).is_dir()


def shard_files(source_format: str, num_features: int) -> list[str]:
    """The file names of one shard, in the order they are written."""
    if source_format == "tsv":
        return ["labels.npy", "dense.npy", "ids.npy", "present.npy"]
    return ["labels.npy", "dense.npy"] + [f"bag{f}.{part}.npy" for f in range(num_features)
                                          for part in ("values", "offsets")]


# -------------------------------------------------------------------------------- checks


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of `directory`, of this format version; PreparedDataError naming the file otherwise."""
    file = Path(directory) / MANIFEST
    try:
        raw = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise PreparedDataError(f"{file}: no manifest: not prepared data, or a prepare that did not finish; "
                                f"run `hybridrec data prepare SRC... --out {directory}`") from None
    except (OSError, ValueError) as exc:
        raise PreparedDataError(f"{file}: unreadable manifest ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise PreparedDataError(f"{file}: not a prepared-data manifest (format {FORMAT!r} expected)")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise PreparedDataError(f"{file}: prepared with format version {version} (by hybridrec "
                                f"{raw.get('hybridrec_version')}); this hybridrec reads version {FORMAT_VERSION}: "
                                f"re-run `hybridrec data prepare` (with --force) to write it again")
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise PreparedDataError(f"{file}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    if manifest.checksum != CHECKSUM:
        raise PreparedDataError(f"{file}: checksums are {manifest.checksum}; this hybridrec checks {CHECKSUM}: "
                                f"re-run `hybridrec data prepare` (with --force) to write it again")
    return manifest


def schema_differences(prepared: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """'key: prepared X, config Y' for every dotted key whose value differs."""
    flat_a, flat_b = _flatten(prepared), _flatten(config)
    return [f"{key}: prepared {flat_a.get(key, '(none)')!r}, config {flat_b.get(key, '(none)')!r}"
            for key in sorted(set(flat_a) | set(flat_b), key=_natural) if flat_a.get(key) != flat_b.get(key)]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list) and tree and all(isinstance(v, dict) for v in tree):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _natural(key: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


def check_schema(directory: str | os.PathLike, manifest: Manifest, config: Config) -> None:
    """Refuse prepared data whose IDs or dense values the config would make differently, naming the keys."""
    expected = schema(config)
    if manifest.fingerprint == fingerprint(expected) and manifest.schema_ == expected:
        return
    diff = schema_differences(manifest.schema_, expected)
    raise PreparedDataError(f"{Path(directory) / MANIFEST}: prepared for another config: "
                            f"{'; '.join(diff[:5])}{' ...' if len(diff) > 5 else ''}; re-run `hybridrec data "
                            f"prepare --config CONFIG --force` with this config")


def check_files(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Every shard file exists with its manifest size and checksum; else the file is named."""
    expected = shard_files(manifest.schema_["data.format"], len(manifest.schema_["features"]))
    for shard in manifest.shards:
        if sorted(shard.files) != sorted(expected):
            raise PreparedDataError(f"{Path(directory) / MANIFEST}: shard {shard.name} lists {sorted(shard.files)}, "
                                    f"expected {expected}")
        for name, entry in shard.files.items():
            path = Path(directory) / shard.name / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise PreparedDataError(f"{path}: missing (listed in the manifest); re-run prepare") from None
            if size != entry.bytes:
                raise PreparedDataError(f"{path}: {size} bytes, the manifest says {entry.bytes}; the file was "
                                        f"changed or cut short: re-run prepare")
            if checksum(path) != entry.checksum:
                raise PreparedDataError(f"{path}: checksum differs from the manifest's; the file was changed: "
                                        f"re-run prepare")


def stale_sources(manifest: Manifest) -> list[str]:
    """Source files that still exist but changed since they were prepared (the prepared data is then stale)."""
    out = []
    for source in manifest.sources:
        try:
            st = os.stat(source.path)
        except OSError:
            continue  # moved or deleted: the prepared copy stands on its own
        if (st.st_size, st.st_mtime_ns) != (source.bytes, source.mtime_ns):
            out.append(source.path)
    return out


def open_dataset(directory: str | os.PathLike, config: Config) -> Manifest:
    """The manifest of a prepared directory that `config` may read: version, schema, file sizes and checksums
    checked."""
    manifest = read_manifest(directory)
    check_schema(directory, manifest, config)
    check_files(directory, manifest)
    for path in stale_sources(manifest):
        _log.warning("%s: prepared data from %s, which changed since; re-run prepare to pick the change up",
                     directory, path)
    return manifest


def verify(directory: str | os.PathLike, config: Config | None = None) -> Manifest:
    """Everything `open_dataset` checks (the schema only with a config), plus every array's header."""
    manifest = read_manifest(directory)
    if config is not None:
        check_schema(directory, manifest, config)
    check_files(directory, manifest)
    for shard in manifest.shards:
        _load_shard(Path(directory), manifest, shard)  # headers: dtype and shape against the manifest
    return manifest


# -------------------------------------------------------------------------------- reading


def _load(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only memory map of one .npy file, refused naming it when its dtype or shape is not the manifest's."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise PreparedDataError(f"{path}: not a readable .npy file ({exc}); re-run prepare") from None
    if array.dtype != dtype or array.shape != shape:
        raise PreparedDataError(f"{path}: holds {array.dtype} {array.shape}, the manifest implies {np.dtype(dtype)} "
                                f"{shape}; re-run prepare")
    return array


@dataclass
class MappedShard:
    """A shard's arrays, memory-mapped: nothing is read until a batch is sliced (`slice` gives its `Rows`)."""

    labels: np.ndarray
    dense: np.ndarray
    columns: tuple[np.ndarray, np.ndarray] | None  # TSV: ids and present, (n, features)
    bags: list[Bag] | None  # Parquet: one per feature

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> Rows:
        if self.columns is not None:
            ids, present = self.columns
            return Rows.from_columns(self.labels[start:stop], self.dense[start:stop], ids[start:stop],
                                     present[start:stop])
        return Rows(self.labels[start:stop], self.dense[start:stop],
                    KeyedBags.from_bags([b.slice(start, stop) for b in self.bags or []]))


def _load_shard(directory: Path, manifest: Manifest, shard: ShardEntry) -> MappedShard:
    """The shard's arrays, memory-mapped (nothing is read until a batch is sliced)."""
    where, n, sch = directory / shard.name, shard.rows, manifest.schema_
    num_labels = len(sch["data.labels"]) + ("data.weight_column" in sch)  # the weights are one more column
    num_dense, num_features = len(sch["data.dense_columns"]), len(sch["features"])
    labels = _load(where / "labels.npy", np.float32, (n,) if num_labels == 1 else (n, num_labels))
    dense = _load(where / "dense.npy", np.float32, (n, num_dense))
    if sch["data.format"] == "tsv":
        return MappedShard(labels, dense, (_load(where / "ids.npy", np.uint64, (n, num_features)),
                                           _load(where / "present.npy", np.bool_, (n, num_features))), None)
    bags = []
    for f in range(num_features):
        offsets = _load(where / f"bag{f}.offsets.npy", np.int64, (n + 1,))
        nnz = int(offsets[-1])
        if int(offsets[0]) != 0 or nnz < 0:
            raise PreparedDataError(f"{where / f'bag{f}.offsets.npy'}: offsets must run from 0; re-run prepare")
        bags.append(Bag(_load(where / f"bag{f}.values.npy", np.uint64, (nnz,)), offsets))
    return MappedShard(labels, dense, None, bags)


@dataclass(frozen=True)
class _Shard:
    directory: Path
    manifest: Manifest
    entry: ShardEntry

    def load(self) -> MappedShard:
        return _load_shard(self.directory, self.manifest, self.entry)


def _shards(directories: Sequence[str], config: Config) -> list[_Shard]:
    """Every shard of the listed directories, in order: the `file` of a Position counts across them."""
    out = []
    for directory in directories:
        manifest = open_dataset(directory, config)
        out += [_Shard(Path(directory), manifest, entry) for entry in manifest.shards]
    return out


def _count_shard(counters: ReadCounters, shard: _Shard) -> None:
    """The source's skipped and truncated rows, counted once a shard has been read to its end."""
    counters.bad_lines += shard.entry.bad_lines
    counters.truncated_rows += shard.entry.truncated_rows
    counters.count_nonfinite(shard.manifest.sources[shard.entry.source].path, shard.entry.non_finite_rows)


def _finite(rows: Rows, shard: _Shard, begin: int, policy: BadLinePolicy, counters: ReadCounters) -> Rows:
    """`rows` (the shard's from row `begin`) without a row holding a NaN or infinite dense value: prepared data
    of this version holds none (prepare applies data.non_finite), but a shard prepared before it could, and a
    NaN must not reach the model. ERROR: PreparedDataError naming the shard, its row and the column."""
    finite = np.isfinite(rows.dense).all(axis=1)
    if finite.all():
        return rows
    i = int(np.flatnonzero(~finite)[0])
    where = shard.directory / shard.entry.name
    if policy is BadLinePolicy.ERROR:
        j = int(np.flatnonzero(~np.isfinite(rows.dense[i]))[0])
        raise PreparedDataError(f"{where}: row {begin + i}: dense column {j} is {rows.dense[i, j]}, not a finite "
                                f"number (data.non_finite: skip to skip such rows; re-run prepare)")
    counters.count_nonfinite(str(where), int((~finite).sum()))
    keep = np.flatnonzero(finite)
    return Rows(rows.labels[keep], rows.dense[keep], rows.bags.take(keep))


def shard_rows(directories: Sequence[str]) -> list[int]:
    """The rows of every shard of the listed directories, in order, from their manifests alone (what the
    data loaders' splits cut: splits.row_split)."""
    return [shard.rows for directory in directories for shard in read_manifest(directory).shards]


def iter_train_batches(directories: Sequence[str], config: Config, *, counters: ReadCounters,
                       start: Position = Position(), split: Split | None = None) -> Iterator[tuple[Rows, Position]]:
    """Training batches from `start` on (of this loader's `split`: a row range per shard), each with the
    position after it (epoch, shard, row, row + 1): the batches of `batching.iter_train_batches` /
    `parquet.iter_train_batches` over the source files."""
    shards = _shards(directories, config)
    if start != Position() and (start.file >= len(shards) or start.offset > shards[start.file].entry.rows):
        raise PreparedDataError(f"resume position {start.as_list()} is outside the prepared data ({len(shards)} "
                                f"shards of {[s.entry.rows for s in shards]} rows): it was taken on other data")
    return _train(shards, config.training.epochs, config.training.batch_size, counters, start,
                  split or whole(len(shards)), BadLinePolicy(config.data.non_finite))


def _train(shards: list[_Shard], epochs: int, batch_size: int, counters: ReadCounters,
           start: Position, split: Split, policy: BadLinePolicy) -> Iterator[tuple[Rows, Position]]:
    for epoch in range(start.epoch, epochs):
        for index, (shard, part) in enumerate(zip(shards, split)):
            if (epoch, index) < (start.epoch, start.file) or part is None:
                continue
            rows = shard.load()
            stop = len(rows) if part.stop is None else part.stop
            first = max(start.offset, part.start) if (epoch, index) == (start.epoch, start.file) else part.start
            for begin in range(first, stop, batch_size):
                end = min(begin + batch_size, stop)
                batch = _finite(rows.slice(begin, end), shard, begin, policy, counters)
                counters.rows += len(batch)
                if len(batch):
                    yield batch, Position(epoch, index, end, end + 1)
            if stop == len(rows):  # the loader that reads the shard's end counts its source's bad lines
                _count_shard(counters, shard)


def iter_rows(directories: Sequence[str], config: Config, *, counters: ReadCounters,
              split: Split | None = None) -> Iterator[Rows]:
    """Every shard's rows in order (of this loader's `split`), in chunks of `data.chunk_rows` (the eval
    stream)."""
    shards = _shards(directories, config)
    chunk_rows = config.data.chunk_rows
    return _chunks(shards, chunk_rows, counters, split or whole(len(shards)), BadLinePolicy(config.data.non_finite))


def _chunks(shards: list[_Shard], chunk_rows: int, counters: ReadCounters, split: Split,
            policy: BadLinePolicy) -> Iterator[Rows]:
    for shard, part in zip(shards, split):
        if part is None:
            continue
        rows = shard.load()
        stop = len(rows) if part.stop is None else part.stop
        for begin in range(part.start, stop, chunk_rows):
            end = min(begin + chunk_rows, stop)
            chunk = _finite(rows.slice(begin, end), shard, begin, policy, counters)
            counters.rows += len(chunk)
            if len(chunk):
                yield chunk
        if stop == len(rows):
            _count_shard(counters, shard)
