"""`hybridrec predict BUNDLE DATA... --out FILE`: offline batch scoring of a model bundle (back-fills).

The data is read by the data loader's own readers, configured by the job's
config the bundle carries (`config.yaml`): TSV, Parquet or prepared data,
hashed, truncated and transformed exactly as training read it. Each chunk's
features become one `hybridrec.core.wire.jagged.KeyedBags`, and from there the
inference service's code answers: `LoadedModel.predict`, the one owner of
a request's lookup, pooling and forward pass. So a row scored here and the same row sent to
`hybridrec serve inference` by feature name get the same probability (the
service's input decoder hashes as the readers do).

The output has one probability column per task, named by the task's label
column (`probability` with one task), one row per good input row, in order:
Parquet when FILE ends in .parquet, CSV otherwise.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from hybridrec.core.layouts.bundle import bundle_config


@dataclass(frozen=True)
class Predicted:
    rows: int
    columns: list[str]
    out: Path


def predict(bundle: Path, data: Sequence[str], out: Path) -> Predicted:
    """Score every good row of `data` with `bundle`; write the predictions to `out` (a binary task's
    probability, a regression task's value)."""
    from services.dataloader import batching, sources
    from services.inference.inputs import Samples
    from services.inference.model import load_model

    config = bundle_config(bundle)
    config = config.model_copy(update={"data": config.data.model_copy(update={"eval": [str(p) for p in data]})})
    model = load_model(bundle)
    parts: list[np.ndarray] = []

    async def score() -> None:
        for rows in sources.eval_rows(config, batching.ReadCounters()):
            parts.append(await model.predict(Samples(rows.bags, rows.dense)))

    asyncio.run(score())
    probs = np.concatenate(parts) if parts else np.zeros((0, model.outputs) if model.outputs > 1 else 0, np.float32)
    columns = (config.data.label_names if model.outputs > 1 else
               ["probability" if config.data.tasks[0].binary else "value"])
    write(out, columns, probs.reshape(probs.shape[0], len(columns)))
    return Predicted(int(probs.shape[0]), columns, out)


def write(out: Path, columns: list[str], probs: np.ndarray) -> None:
    import pyarrow as pa

    table = pa.table({name: probs[:, k] for k, name in enumerate(columns)})
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, out)
    else:
        import pyarrow.csv as csv

        csv.write_csv(table, out)
