"""`hybridrec data`: data sets written, converted, replayed, prepared and verified. Each command checks its
options and calls the module that does the work: synthetic data (hybridrec/app/data/synth_set.py), the replay
(hybridrec/app/data/replay.py), the Parquet conversion (hybridrec/app/data/parquet_data.py), and the data
loader's prepared directories (services/dataloader/prepared_write.py, prepared.py)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from hybridrec.core.config import Config, ConfigError
from hybridrec.app.cli.common import SetOption, fail, load

group = typer.Typer(no_args_is_help=True, help="Datasets.")


@group.command("synth")
def data_synth(out: Path = typer.Option(..., "--out", help="Output directory."),
               rows: int = typer.Option(..., "--rows", min=1, help="Training rows."),
               eval_rows: Optional[int] = typer.Option(None, "--eval-rows", min=1, help="Held-out rows."),
               seed: int = typer.Option(0, "--seed"),
               gzip: bool = typer.Option(False, "--gzip", help="Write .tsv.gz files."),
               format: str = typer.Option("tsv", "--format",
                                          help="tsv: Criteo-format files; parquet: the multi-task data set (multi-hot "
                                               "and sequence features, two correlated binary tasks, a regression "
                                               "label watch_time, a sample-weight column weight)."),
               drift_at: Optional[int] = typer.Option(None, "--drift-at", min=0, help="Plant a drift: from this "
                                                      "training row on, --drift-ids IDs (tsv: of one slot; parquet: "
                                                      "items) change their effect; the eval file is drawn after it."),
               drift_slot: Optional[int] = typer.Option(None, "--drift-slot", min=0, max=25, help="tsv: the "
                                                        "drifted slot, 0-25 (C1 is 0; default: the fullest slot of "
                                                        "1,000 IDs or more outside the planted interactions)."),
               drift_ids: int = typer.Option(8, "--drift-ids", min=1, help="How many IDs drift: the 5th most "
                                             "frequent and the next ones."),
               drift_shift: float = typer.Option(1.5, "--drift-shift", help="What the drift adds to each drifted "
                                                 "ID's effect, in logits (parquet: to both tasks')."),
               ids: Optional[float] = typer.Option(None, "--ids", help="tsv: about this many distinct IDs in the "
                                                   "training file (up to 1e9; e.g. 1e8 in 3e7 rows): rare IDs "
                                                   "drawn beside each large slot's planted ones."),
               tail_share: Optional[float] = typer.Option(None, "--tail-share", help="With --ids: the share of "
                                                          "the large slots' occurrences that are rare IDs, fixed "
                                                          "(their vocabulary sized to --ids instead): data sets "
                                                          "of other --ids with the same IDs per batch."),
               negative_rate: Optional[float] = typer.Option(None, "--negative-rate", help="parquet: keep each "
                                                             "training row whose click is 0 with this probability "
                                                             "(0 < R <= 1), at weight 1/R in the weight column; "
                                                             "positives and the eval file keep weight 1.")):
    """Write train/eval files drawn from a planted model, and its oracle AUC (per task for parquet, and the
    RMSE and MAE of watch_time's true mean)."""
    from hybridrec.app.data.synth_set import SynthOptions, write

    options = SynthOptions(out=out, rows=rows, eval_rows=eval_rows, seed=seed, gzip=gzip, format=format,
                           drift_at=drift_at, drift_slot=drift_slot, drift_ids=drift_ids, drift_shift=drift_shift,
                           ids=ids, tail_share=tail_share, negative_rate=negative_rate)
    try:
        lines = write(options)
    except ValueError as exc:
        fail(str(exc))
    for line in lines:
        typer.echo(line)


@group.command("replay")
def data_replay(files: list[Path] = typer.Argument(..., metavar="FILE...", help="Criteo TSV (.gz) files, or Parquet "
                                                   "files (published as Arrow record batches), in order."),
                to: str = typer.Option(..., "--to", help="nats://HOST:PORT/SUBJECT (data.stream's broker and "
                                       "subject)."),
                rate: float = typer.Option(10_000.0, "--rate", min=0, help="Events a second (0: as fast as the "
                                           "broker takes them)."),
                stream: str = typer.Option("HYBRIDREC_EVENTS", "--stream", help="The JetStream stream (created "
                                           "when missing; data.stream.stream)."),
                rows_per_message: int = typer.Option(100, "--rows-per-message", min=1, max=65535),
                first_event: int = typer.Option(0, "--first-event", min=0, help="Id of the first line."),
                limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Publish this many lines."),
                partitions: int = typer.Option(1, "--partitions", min=1, max=1024, help="Message m to subject "
                                               "SUBJECT.<m mod P>, then an end marker to each (P > 1: one per data "
                                               "loader of the job, cluster.dataloader); 1: SUBJECT itself."),
                config_path: Optional[Path] = typer.Option(None, "--config", help="Parquet: publish the columns "
                                                           "this job reads (labels, dense columns, each feature's "
                                                           "column); a file without one is refused, naming it."),
                overrides: Optional[list[str]] = typer.Option(None, "--set", help="KEY=VALUE override of --config."),
                columns: Optional[str] = typer.Option(None, "--columns", help="Parquet: publish these columns "
                                                      "(comma-separated) instead; default: every column."),
                retry_s: float = typer.Option(120.0, "--retry-s", min=0, help="How long a broker that does not "
                                              "answer (restarting) is waited for.")):
    """Publish data files as a timed event stream on NATS JetStream (for data.stream)."""
    from hybridrec.app.data.replay import ReplayRefused, ReplayRequest, publish

    request = ReplayRequest(files=files, to=to, rate=rate, stream=stream, rows_per_message=rows_per_message,
                            first_event=first_event, limit=limit, partitions=partitions, config_path=config_path,
                            overrides=overrides, columns=columns, retry_s=retry_s)
    try:
        typer.echo(publish(request))
    except ReplayRefused as exc:
        fail(str(exc))


@group.command("to-parquet")
def data_to_parquet(src: Path = typer.Argument(..., help="Criteo TSV file (not gzip)."),
                    dst: Path = typer.Argument(..., help="Parquet file to write."),
                    row_group_rows: int = typer.Option(131_072, "--row-group-rows", min=1)):
    """Convert a Criteo TSV file to Parquet (the same samples: identical batches, see README "Parquet input")."""
    from hybridrec.app.data.parquet_data import tsv_to_parquet

    if not src.is_file():
        fail(f"{src}: no such file")
    started = time.monotonic()
    rows = tsv_to_parquet(src, dst, row_group_rows=row_group_rows)
    typer.echo(f"wrote {rows} rows to {dst} in {time.monotonic() - started:.1f} s")


def _prepare_config(config_path: Optional[Path], overrides: Optional[list[str]], sources: list[Path]) -> Config:
    """The job's config (its features, data.format, labels, dense columns, bad_lines decide what is written), or
    without one the default Criteo features, Parquet if every source ends in .parquet."""
    if config_path is not None:
        return load(config_path, overrides)
    from hybridrec.core.config import apply_overrides, from_dict

    parquet = [s.suffix == ".parquet" for s in sources]
    if any(parquet) and not all(parquet):
        fail("SRC: Parquet and other files together; prepare each format on its own (or give --config)")
    fmt = "parquet" if all(parquet) else "tsv"
    tree: dict = {"data": {"train": [str(s) for s in sources], "format": fmt}}
    try:
        return from_dict(apply_overrides(tree, overrides), source="--set")
    except ConfigError as exc:
        fail(str(exc))


@group.command("prepare")
def data_prepare(sources: list[Path] = typer.Argument(..., metavar="SRC...", help="Criteo TSV (.gz) or Parquet "
                                                      "files: one shard each, in this order."),
                 out: Path = typer.Option(..., "--out", help="Prepared directory to write (written beside it as "
                                          "DIR.partial-<pid>, renamed when complete)."),
                 config_path: Optional[Path] = typer.Option(None, "--config", help="The job's config: its "
                                                            "data.format, labels, dense columns, features and "
                                                            "bad_lines decide the IDs and values (default: the "
                                                            "26 Criteo features)."),
                 overrides: Optional[list[str]] = SetOption,
                 force: bool = typer.Option(False, "--force", help="Replace DIR if it exists.")):
    """Hash IDs and transform dense values once: the data loader then memory-maps batches, parsing nothing."""
    from services.dataloader import prepared_write as writer

    config = _prepare_config(config_path, overrides, sources)
    started = time.monotonic()

    def shard_done(shard) -> None:
        typer.echo(f"  {shard.name}: {shard.rows:,} rows ({shard.bad_lines:,} bad) "
                   f"from {sources[shard.source]}", err=True)

    try:
        manifest = writer.prepare(sources, out, config, force=force, on_shard=shard_done)
    except (ConfigError, FileNotFoundError, ValueError) as exc:  # a bad line under bad_lines: error, a bad Parquet
        fail(str(exc))
    size = sum(f.bytes for s in manifest.shards for f in s.files.values())
    typer.echo(f"wrote {out}: {len(manifest.shards)} shard(s), {manifest.rows:,} rows, {size / 2**20:.1f} MiB in "
               f"{time.monotonic() - started:.1f} s")


@group.command("verify")
def data_verify(directory: Path = typer.Argument(..., metavar="DIR", help="A prepared directory."),
                config_path: Optional[Path] = typer.Option(None, "--config", help="Also check that this config "
                                                           "reads the same IDs and values (its schema)."),
                overrides: Optional[list[str]] = SetOption):
    """Check a prepared directory fully: manifest, every file's size and checksum, array headers."""
    from services.dataloader import prepared

    config = load(config_path, overrides) if config_path is not None else None
    started = time.monotonic()
    try:
        manifest = prepared.verify(directory, config)
    except ConfigError as exc:
        fail(str(exc))
    size = sum(f.bytes for s in manifest.shards for f in s.files.values())
    typer.echo(f"ok: {directory}: {len(manifest.shards)} shard(s), {manifest.rows:,} rows, {size / 2**20:.1f} MiB "
               f"checked in {time.monotonic() - started:.1f} s")


