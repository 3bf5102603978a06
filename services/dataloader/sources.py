"""On the data loader: the training and eval streams of the configured format (`data.format`), as `Rows`.

TSV goes through the Criteo reader, Parquet through `parquet.py`, directories
written by `hybridrec data prepare` through `prepared.py` (memory-mapped, no
parsing); what comes out is the same `Rows` type, so batching, dealing and
the frames are one path for all three. A list of files is all raw files or
all prepared directories: one stream has one kind of `Position`. With several
data loaders each reads its own split of the files (`split`, splits.py).

The training data is one `TrainingSource`, chosen once for the config
(`training_source`): the files through one of the three readers, or a stream
(`data.stream`, stream.py's `StreamSource`). Each reader is behind the same
`batches(start, counters)`, and what only a stream does (acknowledge what is
trained, settle its account, end on SIGUSR1) is behind the same calls too, so
the loader's server (server.py) never asks which kind it reads.
"""
from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from pathlib import Path
from typing import Awaitable, Callable, Iterator, Protocol, Sequence, runtime_checkable

from hybridrec.core.config import Config, ConfigError
from hybridrec.core.layouts.criteo_format import feature_columns
from services.dataloader import batching, prepared, splits, tsv
from services.dataloader.batching import Position, ReadCounters, Rows
from services.dataloader.splits import Split


def is_prepared(paths: Sequence[str], key: str) -> bool:
    """Whether `paths` (the list under config key `key`) are prepared directories; a mix is refused."""
    kinds = [prepared.is_prepared(p) for p in paths]
    if any(kinds) and not all(kinds):
        dirs = [p for p, k in zip(paths, kinds) if k]
        files = [p for p, k in zip(paths, kinds) if not k]
        raise ConfigError(f"{key}: mixes prepared directories ({', '.join(dirs)}) and raw files "
                          f"({', '.join(files)}); prepare every file (`hybridrec data prepare`), or list raw "
                          f"files only")
    return bool(kinds) and all(kinds)


def check_prepared(config: Config) -> None:
    """Before a run: every prepared directory of `data.train` and `data.eval` opens for this config (manifest,
    version, schema, file sizes); raw files are left to the readers' own checks."""
    for key, paths in (("data.train", config.data.train), ("data.eval", config.data.eval)):
        if is_prepared(paths, key):
            for path in paths:
                prepared.open_dataset(Path(path), config)


CHECK_ROWS = 4096
"""Rows of each raw file `check_first_rows` reads through the loader's own code before a run starts."""


def check_first_rows(config: Config, rows: int = CHECK_ROWS) -> None:
    """Before a run: every raw file of `data.train` and `data.eval` is opened and its first `rows` rows read
    exactly as the data loader will read them (its readers, the config's columns, transforms and policies), so
    that what the loader would refuse there — a column of the wrong type, a float ID that is not whole, a bad
    line or label under `data.bad_lines: error`, a NaN under `data.non_finite: error` — is refused now, naming
    file, row and key (a Parquet file's schema is checked whole: `parquet.check_columns`)."""
    data = config.data
    for key, paths in (("data.train", data.train), ("data.eval", data.eval)):
        if is_prepared(paths, key):
            continue
        for path in paths:
            if data.format == "parquet":
                from services.dataloader import parquet

                chunks = parquet.read_parquet(path, parquet.ParquetSpec.from_config(config), chunk_rows=rows,
                                              bad_lines=data.bad_lines, non_finite=data.non_finite)
            else:
                _, groups = feature_columns(config.features)
                chunks = tsv.read_criteo(path, groups=groups, chunk_rows=rows, bad_lines=data.bad_lines,
                                         non_finite=data.non_finite, block_bytes=min(tsv.DEFAULT_BLOCK_BYTES, 1 << 20))
            next(iter(chunks), None)


def split(config: Config, key: str, loader: int) -> Split | None:
    """Data loader `loader`'s part of the files under `key` (data.train or data.eval; prepared data: of their
    shards), one of len(cluster.dataloader) nearly equal parts (splits.py); None (everything) with one loader."""
    paths: list[str] = getattr(config.data, key.removeprefix("data."))
    loaders = len(config.cluster.dataloader)
    if loaders == 1:
        return None
    if is_prepared(paths, key):
        return splits.row_split(prepared.shard_rows(paths), loader, loaders)
    if config.data.format == "parquet":
        from services.dataloader import parquet  # pyarrow: imported where Parquet is read (see eval_rows)

        return splits.group_split([parquet.row_groups(path) for path in paths], loader, loaders)
    gzipped = [tsv.is_gzip(path) for path in paths]
    return splits.tsv_split(paths, gzipped, [os.path.getsize(path) for path in paths], loader, loaders)


def check_splits(config: Config) -> None:
    """Before a run: every data loader gets some of the training data; else ConfigError naming
    cluster.dataloader (a gzip file, a Parquet row group, a prepared row is read by one loader only).
    Evaluation data may leave a loader without any: it ends the phase at once."""
    paths, loaders = config.data.train, len(config.cluster.dataloader)
    if loaders == 1 or not paths:
        return
    if is_prepared(paths, "data.train"):
        rows = sum(prepared.shard_rows(paths))
        splits.refuse_empty([split(config, "data.train", l) for l in range(loaders)], "data.train",
                            f"{rows} prepared row{'s' if rows != 1 else ''}",
                            "list fewer data loaders, or prepare more data")
        return
    if config.data.format == "parquet":
        from services.dataloader import parquet

        groups = sum(len(parquet.row_groups(path)) for path in paths)
        splits.refuse_empty([split(config, "data.train", l) for l in range(loaders)], "data.train",
                            f"{groups} Parquet row group{'s' if groups != 1 else ''} (each read by one loader)",
                            "list at most as many data loaders as row groups, or write smaller row groups")
        return
    gzipped = [tsv.is_gzip(path) for path in paths]
    if all(gzipped):  # plain files are cut at any line, so every loader gets a part of them
        splits.refuse_empty([split(config, "data.train", l) for l in range(loaders)], "data.train",
                            f"{len(paths)} gzip file{'s' if len(paths) != 1 else ''} (each read whole by one "
                            f"loader)", "list at most as many data loaders as gzip files, split the data into "
                            "more files, or decompress it (plain TSV is cut into byte ranges)")


@runtime_checkable
class TrainingSource(Protocol):
    """Where data loader `loader`'s training batches come from: its split of the files (TSV, Parquet, prepared
    directories) or its partition of a stream. Why one protocol: the server sends any source's batches the same
    way, and what differs between them (a stream's consumer, acknowledgements, account and SIGUSR1) is behind
    these calls, which a file source answers by doing nothing (`FileSource`)."""

    kind: str
    """tsv, parquet, prepared or stream: which reader this is."""
    on_trained: Callable[[list[Position]], None] | None
    """Called with the positions after training batches newly known trained, in order (a stream acknowledges
    their messages and counts their lag); None: the source needs no word of it (files)."""
    waits_after_evaluation: bool
    """After sending its eval data the loader waits until every rank is past training (files with several
    loaders: the other loaders' batches may keep the ranks training a while, and a replacement of a rank lost
    meanwhile still gets this loader's share; a stream has waited for that at the end of training)."""

    def handle_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Install what the source answers to on `loop` (a stream: SIGUSR1 ends training with what was read)."""

    async def open(self, start: Position, executor: Executor) -> None:
        """Before the first batch: get ready to read from `start` (a stream: its predecessor's account, the
        consumer at `start`, connected on `executor`, the loader's reader thread)."""

    def batches(self, start: Position, counters: ReadCounters) -> Iterator[tuple[Rows, Position]]:
        """Training batches of `training.batch_size` rows (a file's last may be smaller; a stream's too, when it
        pauses) from `start` on, each with the position right after it; what was read counted in `counters`."""

    async def end_training(self, wait_trained: Callable[[], Awaitable[bool]]) -> None:
        """After the training data is sent (a stream: once all is trained, `wait_trained`, its last messages
        acknowledged and its account written)."""

    async def settle_trained(self) -> None:
        """Every rank already had the end of training when this loader started: settle what a predecessor read
        (a stream: its account, and its messages acknowledged)."""

    def close(self) -> None:
        """Let go of what the source holds (a stream: its consumer's connection and thread)."""


class FileSource(ABC):
    """Data loader `loader`'s split of the `data.train` files through one of the three file readers. Why a base
    class: files need none of a stream's calls, so they are no-ops once here and each reader says only how it
    reads (`batches`); the split is computed when reading starts, as the readers always did."""

    kind = "files"
    on_trained = None

    def __init__(self, config: Config, loader: int = 0):
        self.config, self.loader = config, loader
        self.waits_after_evaluation = len(config.cluster.dataloader) > 1

    @abstractmethod
    def batches(self, start: Position, counters: ReadCounters) -> Iterator[tuple[Rows, Position]]:
        """See `TrainingSource.batches`."""

    def split(self) -> Split | None:
        return split(self.config, "data.train", self.loader)

    def handle_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    async def open(self, start: Position, executor: Executor) -> None:
        pass

    async def end_training(self, wait_trained: Callable[[], Awaitable[bool]]) -> None:
        pass

    async def settle_trained(self) -> None:
        pass

    def close(self) -> None:
        pass


class TsvSource(FileSource):
    """Criteo TSV files (plain or gzip), through `batching.iter_train_batches` and the TSV reader."""

    kind = "tsv"

    def batches(self, start: Position, counters: ReadCounters) -> Iterator[tuple[Rows, Position]]:
        data, training = self.config.data, self.config.training
        part = self.split()
        columns, groups = feature_columns(self.config.features)
        return batching.iter_train_batches(data.train, epochs=training.epochs, batch_size=training.batch_size,
                                           columns=columns, groups=groups, bad_lines=data.bad_lines,
                                           counters=counters, start=start, split=part, non_finite=data.non_finite)


class ParquetSource(FileSource):
    """Parquet files (`data.format: parquet`), through `parquet.iter_train_batches`."""

    kind = "parquet"

    def batches(self, start: Position, counters: ReadCounters) -> Iterator[tuple[Rows, Position]]:
        data, training = self.config.data, self.config.training
        part = self.split()
        from services.dataloader import parquet  # pyarrow: imported where Parquet is read (see eval_rows)

        return parquet.iter_train_batches(data.train, parquet.ParquetSpec.from_config(self.config),
                                          epochs=training.epochs, batch_size=training.batch_size,
                                          bad_lines=data.bad_lines, counters=counters, start=start, split=part,
                                          non_finite=data.non_finite)


class PreparedSource(FileSource):
    """Directories written by `hybridrec data prepare`, through `prepared.iter_train_batches` (memory-mapped).
    A resume position outside the data is refused when `batches` is called, naming it."""

    kind = "prepared"

    def batches(self, start: Position, counters: ReadCounters) -> Iterator[tuple[Rows, Position]]:
        return prepared.iter_train_batches(self.config.data.train, self.config, counters=counters, start=start,
                                           split=self.split())


def file_source(config: Config, loader: int = 0) -> FileSource:
    """The reader of data loader `loader`'s split of `data.train`'s files, by what they are: prepared
    directories, else `data.format` (ConfigError for a list mixing prepared directories and raw files)."""
    if is_prepared(config.data.train, "data.train"):
        return PreparedSource(config, loader)
    if config.data.format == "parquet":
        return ParquetSource(config, loader)
    return TsvSource(config, loader)


def training_source(config: Config, loader: int = 0) -> TrainingSource:
    """The one choice of data loader `loader`'s training data: its partition of `data.stream` when one is
    configured (ConfigError when it names no broker), else its split of the `data.train` files."""
    if config.data.stream is not None:
        from services.dataloader.stream import StreamSource  # the broker's client: loaded where a stream is read

        return StreamSource(config, loader)
    return file_source(config, loader)


def train_batches(config: Config, counters: ReadCounters, start: Position = Position(), loader: int = 0
                  ) -> Iterator[tuple[Rows, Position]]:
    """Training batches of `training.batch_size` rows (a file's last may be smaller) from `start` on, of data
    loader `loader`'s split of the files (whatever `data.stream` says: the files' reader, as checks, tests and
    benchmarks read them)."""
    return file_source(config, loader).batches(start, counters)


def eval_rows(config: Config, counters: ReadCounters, loader: int = 0) -> Iterator[Rows]:
    """Every eval file's rows in order (of data loader `loader`'s split), in chunks of `data.chunk_rows`."""
    data = config.data
    part = split(config, "data.eval", loader)
    if is_prepared(data.eval, "data.eval"):
        return prepared.iter_rows(data.eval, config, counters=counters, split=part)
    if data.format == "parquet":
        from services.dataloader import parquet  # pyarrow starts a thread (jemalloc's) as it is imported: only
        # a loader reading Parquet imports it, never the fork server its process comes from

        return parquet.iter_rows(data.eval, parquet.ParquetSpec.from_config(config), chunk_rows=data.chunk_rows,
                                 bad_lines=data.bad_lines, counters=counters, split=part, non_finite=data.non_finite)
    columns, groups = feature_columns(config.features)
    return batching.iter_rows(data.eval, columns=columns, groups=groups, chunk_rows=data.chunk_rows,
                              bad_lines=data.bad_lines, counters=counters, split=part, non_finite=data.non_finite)
