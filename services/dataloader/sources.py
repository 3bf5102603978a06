"""On the data loader: the training and eval streams of the configured format (`data.format`), as `Rows`.

TSV goes through the Criteo reader, Parquet through `parquet.py`, directories
written by `hybridrec data prepare` through `prepared.py` (memory-mapped, no
parsing); what comes out is the same `Rows` type, so batching, dealing and
the frames are one path for all three. A list of files is all raw files or
all prepared directories: one stream has one kind of `Position`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from hybridrec.config import Config, ConfigError
from hybridrec.criteo_format import feature_columns
from services.dataloader import batching, prepared
from services.dataloader.batching import Position, ReadCounters, Rows


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


def train_batches(config: Config, counters: ReadCounters, start: Position = Position()
                  ) -> Iterator[tuple[Rows, Position]]:
    """Training batches of `training.batch_size` rows (a file's last may be smaller) from `start` on."""
    data, training = config.data, config.training
    if is_prepared(data.train, "data.train"):
        return prepared.iter_train_batches(data.train, config, counters=counters, start=start)
    if data.format == "parquet":
        from services.dataloader import parquet  # pyarrow: imported where Parquet is read (see eval_rows)

        return parquet.iter_train_batches(data.train, parquet.ParquetSpec.from_config(config), epochs=training.epochs,
                                          batch_size=training.batch_size, bad_lines=data.bad_lines,
                                          counters=counters, start=start)
    columns, groups = feature_columns(config.features)
    return batching.iter_train_batches(data.train, epochs=training.epochs, batch_size=training.batch_size,
                                       columns=columns, groups=groups, bad_lines=data.bad_lines, counters=counters,
                                       start=start)


def eval_rows(config: Config, counters: ReadCounters) -> Iterator[Rows]:
    """Every eval file's rows in order, in chunks of `data.chunk_rows`."""
    data = config.data
    if is_prepared(data.eval, "data.eval"):
        return prepared.iter_rows(data.eval, config, counters=counters)
    if data.format == "parquet":
        from services.dataloader import parquet  # pyarrow starts a thread (jemalloc's) as it is imported: only
        # a loader reading Parquet imports it, never the fork server its process comes from

        return parquet.iter_rows(data.eval, parquet.ParquetSpec.from_config(config), chunk_rows=data.chunk_rows,
                                 bad_lines=data.bad_lines, counters=counters)
    columns, groups = feature_columns(config.features)
    return batching.iter_rows(data.eval, columns=columns, groups=groups, chunk_rows=data.chunk_rows,
                              bad_lines=data.bad_lines, counters=counters)
