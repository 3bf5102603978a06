"""On the data loader: the training and eval streams of the configured format (`data.format`), as `Rows`.

TSV goes through the Criteo reader, Parquet through `parquet.py`; what comes
out is the same `Rows` type, so batching, dealing and the frames are one path
for both.
"""
from __future__ import annotations

from typing import Iterator

from hybridrec.config import Config
from hybridrec.criteo import feature_columns
from services.dataloader import batching, parquet
from services.dataloader.batching import Position, ReadCounters, Rows


def train_batches(config: Config, counters: ReadCounters, start: Position = Position()
                  ) -> Iterator[tuple[Rows, Position]]:
    """Training batches of `training.batch_size` rows (a file's last may be smaller) from `start` on."""
    data, training = config.data, config.training
    if data.format == "parquet":
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
    if data.format == "parquet":
        return parquet.iter_rows(data.eval, parquet.ParquetSpec.from_config(config), chunk_rows=data.chunk_rows,
                                 bad_lines=data.bad_lines, counters=counters)
    columns, groups = feature_columns(config.features)
    return batching.iter_rows(data.eval, columns=columns, groups=groups, chunk_rows=data.chunk_rows,
                              bad_lines=data.bad_lines, counters=counters)
