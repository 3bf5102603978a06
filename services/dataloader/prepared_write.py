"""`hybridrec data prepare`: Criteo TSV or Parquet files into a prepared directory (layout: `prepared.py`).

Runs in the CLI's process, once, before training. Each source file is read
by the data loader's own reader (`read_criteo`, `read_parquet`) with the
job's config, so the IDs, dense values and skipped rows are exactly those a
training run would read, and streamed to .npy files chunk by chunk: memory
stays at one chunk whatever the file's size.

Atomicity: everything is written into `DIR.partial-<pid>`, each file and
the directory are fsynced, the manifest is written last, and only then is
the directory renamed to DIR. A prepare killed at any point leaves a
`.partial-<pid>` directory (which the next prepare removes) and never a DIR
without its manifest; a reader refuses a directory without one. An existing
complete DIR is replaced only with `force`, by a rename as well.
"""
from __future__ import annotations

import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from hybridrec.core.config import Config
from hybridrec.core.layouts.criteo_format import feature_columns
from hybridrec.core.layouts.files import fsync_dir, write_json_atomic
from hybridrec.core.wire.jagged import KeyedBags
from services.dataloader import parquet
from services.dataloader.tsv import read_criteo
from services.dataloader.prepared import (MANIFEST, Manifest, PreparedDataError, ShardEntry, ShardFile,
                                          SourceEntry, checksum, fingerprint, hybridrec_version, schema,
                                          shard_files)

_HEADER_BYTES = 128
"""Room reserved for a .npy header, written once the row count is known (a 64-byte multiple, as numpy's)."""


class _NpyWriter:
    """Appends rows to a .npy file whose header (the shape) is written at `close`, so nothing is held in
    memory and nothing is copied twice."""

    def __init__(self, path: Path, dtype: np.dtype, tail: tuple[int, ...]):
        self.path, self.dtype, self.tail = path, np.dtype(dtype), tail
        self.rows = 0
        self.file = open(path, "wb")
        self.file.write(b"\0" * _HEADER_BYTES)

    def append(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self.dtype)
        assert array.shape[1:] == self.tail, (self.path, array.shape, self.tail)
        if array.size:
            self.file.write(memoryview(array).cast("B"))
        self.rows += array.shape[0]

    def close(self) -> ShardFile:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.rows, *self.tail)}
        text = repr(header).encode("latin1")
        pad = _HEADER_BYTES - len(np.lib.format.MAGIC_PREFIX) - 2 - 2 - len(text) - 1
        assert pad >= 0, f"{self.path}: .npy header does not fit in {_HEADER_BYTES} bytes"
        self.file.seek(0)
        self.file.write(np.lib.format.MAGIC_PREFIX + bytes([1, 0]) + struct.pack("<H", _HEADER_BYTES - 10)
                        + text + b" " * pad + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return ShardFile(bytes=self.path.stat().st_size, checksum=checksum(self.path))


@dataclass
class _Chunk:
    """A source chunk in the shard's layout: TSV keeps the reader's columns, Parquet one bag per feature."""

    labels: np.ndarray
    dense: np.ndarray
    bad_lines: int
    truncated_rows: int
    columns: tuple[np.ndarray, np.ndarray] | None = None  # TSV: ids and present (n, features)
    bags: KeyedBags | None = None  # Parquet
    non_finite_rows: int = 0


def _tsv_chunks(path: str, config: Config) -> Iterator[_Chunk]:
    columns, groups = feature_columns(config.features)
    for chunk in read_criteo(path, groups=groups, chunk_rows=config.data.chunk_rows, bad_lines=config.data.bad_lines,
                             non_finite=config.data.non_finite):
        yield _Chunk(chunk.labels, chunk.dense, chunk.num_bad_lines, 0,
                     columns=(chunk.ids[:, columns], chunk.present[:, columns]), non_finite_rows=chunk.num_nonfinite)


def _parquet_chunks(path: str, config: Config) -> Iterator[_Chunk]:
    spec = parquet.ParquetSpec.from_config(config)
    for chunk in parquet.read_parquet(path, spec, chunk_rows=config.data.chunk_rows, bad_lines=config.data.bad_lines,
                                      non_finite=config.data.non_finite):
        yield _Chunk(chunk.rows.labels, chunk.rows.dense, chunk.num_bad_rows, chunk.num_truncated,
                     bags=chunk.rows.bags, non_finite_rows=chunk.num_nonfinite)


def _writers(where: Path, config: Config) -> dict[str, _NpyWriter]:
    """One writer per shard file, named as `prepared.shard_files` lists them."""
    columns, features = config.label_columns, len(config.features)  # the tasks', then a weight column's
    writers = {"labels.npy": _NpyWriter(where / "labels.npy", np.float32, () if columns == 1 else (columns,)),
               "dense.npy": _NpyWriter(where / "dense.npy", np.float32, (config.num_dense,))}
    if config.data.format == "tsv":
        writers["ids.npy"] = _NpyWriter(where / "ids.npy", np.uint64, (features,))
        writers["present.npy"] = _NpyWriter(where / "present.npy", np.bool_, (features,))
    else:
        for f in range(features):
            writers[f"bag{f}.values.npy"] = _NpyWriter(where / f"bag{f}.values.npy", np.uint64, ())
            writers[f"bag{f}.offsets.npy"] = _NpyWriter(where / f"bag{f}.offsets.npy", np.int64, ())
            writers[f"bag{f}.offsets.npy"].append(np.zeros(1, np.int64))
    assert list(writers) == shard_files(config.data.format, features)
    return writers


def _write_shard(source: str, where: Path, config: Config, index: int) -> ShardEntry:
    """Stream one source file into the shard directory `where`."""
    where.mkdir()
    writers = _writers(where, config)
    chunks = _tsv_chunks(source, config) if config.data.format == "tsv" else _parquet_chunks(source, config)
    try:
        return _fill(writers, chunks, where, index, len(config.features))
    finally:
        for writer in writers.values():
            writer.file.close()  # after close() a no-op; on an error, before the partial directory is removed


def _fill(writers: dict[str, _NpyWriter], chunks: Iterator[_Chunk], where: Path, index: int,
          num_features: int) -> ShardEntry:
    """Append every chunk's arrays; close the files (headers, fsync, checksums) when the source ends."""
    nnz = [0] * num_features
    rows = bad = truncated = non_finite = 0
    for chunk in chunks:
        writers["labels.npy"].append(chunk.labels)
        writers["dense.npy"].append(chunk.dense)
        if chunk.columns is not None:  # TSV: the column layout (every feature a bag of at most one ID)
            writers["ids.npy"].append(chunk.columns[0])
            writers["present.npy"].append(chunk.columns[1])
        else:
            for f, bag in enumerate(chunk.bags.bags()):
                writers[f"bag{f}.values.npy"].append(bag.values)
                writers[f"bag{f}.offsets.npy"].append(bag.offsets[1:] + nnz[f])
                nnz[f] += int(bag.offsets[-1])
        rows, bad, truncated = rows + len(chunk.labels), bad + chunk.bad_lines, truncated + chunk.truncated_rows
        non_finite += chunk.non_finite_rows
    files = {name: w.close() for name, w in writers.items()}
    return ShardEntry(name=where.name, source=index, rows=rows, bad_lines=bad, truncated_rows=truncated,
                      non_finite_rows=non_finite, files=files)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(out: Path) -> None:
    """Remove what killed prepares into `out` left: `.partial-<pid>` / `.old-<pid>` of processes now gone."""
    for leftover in [*out.parent.glob(f"{out.name}.partial-*"), *out.parent.glob(f"{out.name}.old-*")]:
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _check_out(out: Path, force: bool) -> None:
    """Refuse to overwrite an existing DIR without `force` (a complete one, or anything not ours)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise PreparedDataError(f"--out {out}: exists and is not a directory")
    if any(out.iterdir()) and not force:
        what = "complete prepared data" if (out / MANIFEST).is_file() else "a non-empty directory"
        raise PreparedDataError(f"--out {out}: already holds {what}; pass --force to replace it")


def prepare(sources: Sequence[str | os.PathLike], out: str | os.PathLike, config: Config, *, force: bool = False,
            on_shard: Callable[[ShardEntry], None] | None = None) -> Manifest:
    """Write the prepared form of `sources` (in `config`'s format, with its features) to `out`, atomically."""
    out = Path(out).absolute()
    paths = [str(Path(s).absolute()) for s in sources]
    for path in paths:
        if not Path(path).is_file():
            raise PreparedDataError(f"{path}: source file not found")
    _check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    partial = out.parent / f"{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        stats = [os.stat(p) for p in paths]
        shards = []
        for index, path in enumerate(paths):
            shards.append(_write_shard(path, partial / f"shard-{index:05d}", config, index))
            fsync_dir(partial / shards[-1].name)
            if on_shard is not None:
                on_shard(shards[-1])
        sch = schema(config)
        manifest = Manifest(hybridrec_version=hybridrec_version(), fingerprint=fingerprint(sch), schema=sch,
                            sources=[SourceEntry(path=p, bytes=st.st_size, mtime_ns=st.st_mtime_ns)
                                     for p, st in zip(paths, stats)], shards=shards)
        write_json_atomic(partial / MANIFEST, manifest.model_dump(mode="json", by_alias=True), fsync=True)
        fsync_dir(partial)
        _replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _replace(partial: Path, out: Path) -> None:
    """Rename the finished directory to `out`; an old `out` is renamed aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        out.rename(old)
    partial.rename(out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
