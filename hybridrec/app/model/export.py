"""`hybridrec export`: a finished run or a job checkpoint as a model bundle (hybridrec/core/layouts/bundle.py).

Part of the app, not of the PS: it runs once, offline, in the CLI, and reads the
shard dumps through their owner (`services/embedding_ps/checkpoint.py`).
From the checkpoint it takes:

* `config.yaml` (every checkpoint carries the job's resolved config): the
  features, num_dense, the model's import path and kwargs, the precision;
* `manifest.json` (the job manifest): the step;
* `dense.pt`: the `model` state_dict (loaded with weights_only=True; the
  optimizer state is left behind);
* `ps/shard-*/`: each shard's keys and their weights (no optimizer state;
  16-bit weights decoded), with the checkpoint's shard count and sharding,
  every file's sha256 verified on the way; with `--quantize int8`, written as
  int8 rows with a float16 scale each.

Every problem is an `ExportError` whose message names the file.
"""
from __future__ import annotations

from pathlib import Path

from hybridrec.core.layouts import checkpoints
from hybridrec.core.layouts.bundle import (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION, BundleManifest, BundleWriter,
                              input_types)
from hybridrec.core.config import ConfigError, load_config


class ExportError(ValueError):
    """A source that cannot be exported or an output that cannot be written; the message names the file."""


def find_checkpoint(source: Path) -> Path:
    """The checkpoint directory SOURCE names: itself, or a run's (or checkpoint root's) newest complete one."""
    source = Path(source)
    if not source.is_dir():
        raise ExportError(f"{source}: not a directory (expected a run directory or a checkpoint directory)")
    if (source / checkpoints.MANIFEST).is_file() and (source / checkpoints.DENSE).exists():
        return source
    if (source / checkpoints.DENSE).exists() or source.name.endswith(".tmp"):
        raise ExportError(f"{source / checkpoints.MANIFEST}: missing; {source} is a checkpoint that was never "
                          "completed (half-written)")
    for root in (source / "checkpoints", source):
        try:
            found = checkpoints.latest(root)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        if found is not None:
            return found[0]
    raise ExportError(f"{source}: no complete checkpoint (neither a checkpoint directory with "
                      f"{checkpoints.MANIFEST} and {checkpoints.DENSE}, nor a run directory with checkpoints/step-*/"
                      f"{checkpoints.MANIFEST})")


def export(source: Path, out: Path, *, quantize: str | None = None) -> tuple[Path, BundleManifest]:
    """Write the bundle `out` from SOURCE; returns the checkpoint used and the bundle's manifest. `quantize`:
    "int8" writes quantized tables (`hybridrec.core.layouts.bundle.quantize_rows`), None float32 ones."""
    import torch

    from services.embedding_ps.checkpoint import read_embeddings

    out = Path(out)
    if out.exists():
        raise ExportError(f"{out}: already exists; choose a new bundle directory")
    path = find_checkpoint(source)
    try:
        job = checkpoints.read_manifest(path)
    except ValueError as exc:
        raise ExportError(f"{path / checkpoints.MANIFEST}: {exc}") from None
    if not (path / checkpoints.CONFIG).is_file():
        raise ExportError(f"{path / checkpoints.CONFIG}: missing (checkpoints written before configs were stored "
                          "in them cannot be exported)")
    try:
        config = load_config(path / checkpoints.CONFIG)
    except ConfigError as exc:
        raise ExportError(f"{path / checkpoints.CONFIG}: {exc}") from None
    try:
        state = torch.load(path / checkpoints.DENSE, map_location="cpu", weights_only=True)
        weights = state["model"]
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; the file is what is wrong
        raise ExportError(f"{path / checkpoints.DENSE}: not a checkpoint's dense state: {exc}") from None
    try:
        ps, tables = read_embeddings(path)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if ps["widths"] != config.dims:
        raise ExportError(f"{path / checkpoints.PS}: embedding widths {ps['widths']}, but "
                          f"{path / checkpoints.CONFIG} has {config.dims}")
    if ps["num_shards"] != job.num_ps or ps["step"] != job.step:
        raise ExportError(f"{path / checkpoints.PS}: dumps of {ps['num_shards']} shards at step {ps['step']}, but "
                          f"{path / checkpoints.MANIFEST} says {job.num_ps} PS at step {job.step}")
    manifest = BundleManifest(step=job.step, features=list(config.features), num_dense=config.num_dense,
                              num_tasks=config.num_tasks, model=config.model, precision=config.training.precision,
                              num_shards=ps["num_shards"], input_types=input_types(config),
                              dense_columns=config.dense_columns, tasks=config.data.label_names,
                              heads=config.data.tasks,
                              quantization=quantize,
                              format_version=QUANTIZED_FORMAT_VERSION if quantize else FORMAT_VERSION)
    writer = BundleWriter(out, manifest)
    try:
        writer.add_dense(weights)
        writer.add_config(config)
        for shard, dim, keys, rows in tables:
            writer.add_table(shard, dim, keys, rows)
        return path, writer.commit()
    except BaseException:
        writer.abort()
        raise


def describe(out: Path, checkpoint: Path, manifest: BundleManifest, seconds: float) -> str:
    """What `hybridrec export` prints: the bundle, where it was read from, its step, shards, rows and size."""
    size = sum(entry.bytes for entry in manifest.files.values())
    rows = ", ".join(f"{n:,} of width {dim}" for dim, n in sorted(manifest.rows.items()))
    return (f"wrote {out} from {checkpoint} in {seconds:.1f} s: step {manifest.step}, "
            f"{manifest.num_shards} shard(s), rows {rows or 'none'}"
            f"{f' ({manifest.quantization})' if manifest.quantization else ''}, {size / 2**20:.1f} MiB")
