"""Criteo TSV to Parquet (`hybridrec data to-parquet`): the same samples in the Parquet schema the reader maps.

Runs wherever data is prepared, not in a service. The file is streamed
(pyarrow's CSV reader, one block at a time) into row groups of
`row_group_rows`: a label column `label` (int8), the dense columns I1..I13 as
float32 holding exactly what the TSV reader computes, log1p(max(x, 0)) with an
empty field as 0, and the categorical columns C1..C26 as strings (an empty
field stays an empty string, which the Parquet reader treats as absent, as
the TSV reader does). The Parquet reader hashes strings as the TSV reader
hashes fields, so both formats give identical batches
(tests/unit/test_parquet.py compares them).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from hybridrec.core.layouts.criteo_format import DENSE_COLUMNS, SPARSE_COLUMNS

DEFAULT_ROW_GROUP_ROWS = 131_072


def criteo_schema() -> pa.Schema:
    """The Parquet schema of a converted Criteo file."""
    return pa.schema([("label", pa.int8()), *((c, pa.float32()) for c in DENSE_COLUMNS),
                      *((c, pa.string()) for c in SPARSE_COLUMNS)])


def tsv_to_parquet(src: str | os.PathLike, dst: str | os.PathLike, *,
                   row_group_rows: int = DEFAULT_ROW_GROUP_ROWS) -> int:
    """Convert one Criteo TSV file (not gzip) to Parquet; returns the rows written. A malformed line raises
    pyarrow's error naming its row (convert only files the TSV reader accepts)."""
    names = ["label", *DENSE_COLUMNS, *SPARSE_COLUMNS]
    types = {"label": pa.int8(), **{c: pa.int64() for c in DENSE_COLUMNS}, **{c: pa.string() for c in SPARSE_COLUMNS}}
    reader = pacsv.open_csv(
        src, read_options=pacsv.ReadOptions(column_names=names, block_size=16 << 20),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=False))
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    schema = criteo_schema()
    written = 0
    pending: list[pa.RecordBatch] = []
    held = 0
    with pq.ParquetWriter(dst, schema) as writer:
        for batch in reader:
            pending.append(_convert(batch, schema))
            held += batch.num_rows
            while held >= row_group_rows:
                table = pa.Table.from_batches(pending, schema)
                writer.write_table(table.slice(0, row_group_rows), row_group_size=row_group_rows)
                rest = table.slice(row_group_rows)
                pending, held = rest.to_batches(), rest.num_rows
                written += row_group_rows
        if held:
            writer.write_table(pa.Table.from_batches(pending, schema), row_group_size=row_group_rows)
            written += held
    return written


def _convert(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """Dense integer columns to the TSV reader's float32 log1p(max(x, 0)); the rest unchanged."""
    columns = [batch.column("label")]
    for name in DENSE_COLUMNS:
        x = batch.column(name).fill_null(0).to_numpy().astype(np.float64)
        columns.append(pa.array(np.log1p(np.maximum(x, 0)).astype(np.float32)))
    columns += [pc.cast(batch.column(c), pa.string()) for c in SPARSE_COLUMNS]
    return pa.RecordBatch.from_arrays(columns, schema=schema)
