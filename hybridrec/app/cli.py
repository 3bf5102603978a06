"""The `hybridrec` command: run, serve, data, health, checkpoint, export.

User mistakes (bad config key, missing data file, model path that does not
import) print one clear message and exit with code 2 — no traceback wall.
A failed run exits 1, Ctrl-C exits 130.

This is the app layer (hybridrec/app/): it imports the services with plain
import statements, inside the commands that run them, so `hybridrec --help`
starts without loading torch or any service. The core library (hybridrec/)
and the services never import it (tests/unit/test_layering.py checks the graph).
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from hybridrec.core.config import Config, ConfigError, EmbeddingOptimizer, load_config
from hybridrec.core.layouts.summary import RunSummary, task_entries, task_row

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Hybrid sync/async training of recommender models with a sharded embedding PS.")
data_app = typer.Typer(no_args_is_help=True, help="Datasets.")
checkpoint_app = typer.Typer(no_args_is_help=True, help="Checkpoints.")
app.add_typer(data_app, name="data")
serve_app = typer.Typer(no_args_is_help=True, help="Run one service in this process (what a container runs).")
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(serve_app, name="serve")

EXIT_USAGE = 2

SET_HELP = "Override a config key: --set training.epochs=2 (repeatable)."
SetOption = typer.Option(None, "--set", help=SET_HELP)


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    typer.echo(f"hybridrec: error: {message}", err=True)
    raise typer.Exit(code)


def _load(path: Path, overrides: Optional[list[str]]) -> Config:
    try:
        return load_config(path, overrides or [])
    except ConfigError as exc:
        _fail(str(exc))


def _fit(config: Config):
    """The config with its `auto` replica lists and thread count sized to this host, and the layout chosen
    (hybridrec/app/layout.py); an `auto` loader count is lowered until the training data splits into that
    many parts (gzip files, Parquet row groups and prepared rows go to one loader each)."""
    from hybridrec.app.layout import Host, fit

    from services.dataloader import sources

    host = Host.here()
    fitted, layout = fit(config, host)
    loaders = layout.dataloader
    while "dataloader" in config.cluster.sized_by_host() and loaders > 1:
        try:
            sources.check_splits(fitted)
            break
        except ConfigError:
            loaders -= 1
            fitted, layout = fit(config, host, max_loaders=loaders)
    return fitted, layout


def _check_ps_fits(config: Config) -> None:
    """A local run's PS shards all on this host: ConfigError naming it, the widths and the bytes unless their
    stores, private arrays and checkpoint buffers fit its memory and their files the free space under
    ps.shm_dir (hybridrec/app/plan.py `check_fits`)."""
    import socket

    from hybridrec.app import plan as planner

    planner.check_fits(config, host=socket.gethostname(), memory_bytes=planner.host_memory_bytes(),
                       shm_free_bytes=planner.free_bytes(config.ps.shm_dir))


def preflight(config: Config, *, model: bool = True, rows: bool = True) -> None:
    """Check what a run needs before starting any process: data files (prepared directories: their manifest,
    schema, file sizes and checksums; raw files: every configured column and its type, and the first rows read
    through the data loader's own code), the feature columns, that every data loader gets a split of the
    training data and that a checkpoint to resume from was written with as many loaders, that the PS shards
    fit this host, and, unless `model` is False, the model (`check_model`); `rows` False leaves the first rows
    to `check_rows` (`hybridrec run` reads them while the services' parents import, before any service
    starts). `hybridrec check` and `hybridrec run` both make every one of these checks, so a config and files
    that `check` passes are not refused by `run` before training."""
    from hybridrec.core.layouts import checkpoints
    from hybridrec.core.layouts.criteo_format import feature_columns

    from services.dataloader import sources

    raw = []  # files read as they are; prepared directories are checked by `check_prepared`
    for key, paths in (("data.train", config.data.train), ("data.eval", config.data.eval)):
        if sources.is_prepared(paths, key):
            continue
        for path in paths:
            if not Path(path).is_file():
                raise ConfigError(f"{key}: data file not found: {path}")
            raw.append(path)
    try:
        sources.check_prepared(config)
        sources.check_splits(config)
        if (found := checkpoints.resume_from(config.checkpoint)) is not None:
            checkpoints.check_loaders(*found, len(config.cluster.dataloader))
        if config.data.format == "parquet":
            from services.dataloader import parquet

            spec = parquet.ParquetSpec.from_config(config)
            for path in raw:
                parquet.check_columns(path, spec)
        else:
            feature_columns(config.features)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_ps_fits(config)
    if rows:
        check_rows(config)
    if model:
        check_model(config)


def data_notes(config: Config) -> list[str]:
    """What is read as configured but likely not as meant: dense columns of counts in a Parquet training file
    read as stored (raw counts train worse than their log1p; the same rows as TSV get log1p)."""
    if config.data.format != "parquet" or not config.data.train or Path(config.data.train[0]).is_dir():
        return []
    from services.dataloader import parquet

    counts = parquet.raw_counts(config.data.train[0], parquet.ParquetSpec.from_config(config))
    if not counts:
        return []
    return [f"data.dense_columns {', '.join(counts)} of {config.data.train[0]} look like counts (whole numbers, "
            f"none negative), read as stored (data.dense_transform: none); counts usually train better as "
            f"log1p(max(x, 0)), as the TSV reader reads them: set data.dense_transform: log1p (or per column)"]


def check_rows(config: Config) -> None:
    """The first rows of every raw data file read through the data loader's own code (`sources.check_first_rows`):
    ConfigError naming file, row and key for what the loader would refuse."""
    from services.dataloader import sources

    try:
        sources.check_first_rows(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_model(config: Config) -> None:
    """Build the configured model once, and import `training.loss` (ConfigError naming what is wrong). It
    imports torch, about 2 core-s:
    `hybridrec run` does it on a thread while the services start, not before."""
    from hybridrec.core.model.models import ModelImportError, build_model, feature_infos
    from hybridrec.core.model.tasks import Tasks

    try:
        build_model(config.model.path, feature_infos(config.features), config.num_dense, config.model.kwargs,
                    num_tasks=config.num_tasks)
    except (ModelImportError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if config.training.loss:  # ConfigError naming training.loss when it does not import, or answers no loss
        Tasks.from_config(config).probe()


@app.command()
def run(config_path: Path = typer.Argument(..., metavar="CONFIG", help="YAML config file."),
        overrides: Optional[list[str]] = SetOption,
        summary_json: Optional[Path] = typer.Option(None, "--summary-json", help="Write the run summary here."),
        run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Logs and results (default runs/<time>).")):
    """Start every service as a local process, train, evaluate, print a summary."""
    from hybridrec.app.forkserver import ForkServers

    config = _load(config_path, overrides)
    try:
        config, layout = _fit(config)
        preflight(config, model=False, rows=False)
    except ConfigError as exc:
        _fail(str(exc))
    run_dir = run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    # The services' parents start importing now, beside the rest of the launcher's own imports and set-up
    # (hybridrec/app/forkserver.py), and beside the first rows' check, which ends before any service starts.
    forkserver = ForkServers(run_dir / "logs")
    forkserver.start()
    try:
        check_rows(config)
    except ConfigError as exc:
        forkserver.close()
        _fail(str(exc))
    for note in data_notes(config):
        typer.echo(f"hybridrec: note: {note}", err=True)
    from hybridrec.core.runtime import log
    from hybridrec.app import launcher
    from hybridrec.app.progress import Progress

    log.setup(service="launcher")
    log.get().info("layout", layout=layout.line())
    for note in layout.notes:
        log.get().warning("layout_adjusted", note=note)
    progress = Progress(config)
    try:
        # The model check imports torch (seconds of CPU): `hybridrec check --only model` forked from the
        # services' pre-imported parent, beside their start-up; a bad model stops the run with exit 2.
        summary = launcher.run_local(config, run_dir, progress=progress, check_model=True, forkserver=forkserver,
                                     layout=layout)
    except ConfigError as exc:
        progress.close()
        _fail(str(exc))
    except launcher.LaunchError as exc:
        progress.close()
        _fail(str(exc), code=1)
    except KeyboardInterrupt:
        progress.close()
        typer.echo("hybridrec: interrupted; every service was stopped", err=True)
        raise typer.Exit(130)
    progress.close()
    if summary_json:
        summary.write(summary_json)
    _print_summary(summary)


def _print_summary(summary: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    from hybridrec.app.report_page import fmt_duration, fmt_int, fmt_rate, fmt_sig

    table = Table(title="hybridrec run", show_header=False)
    phases = summary.phases
    start_up = phases.first_step if phases else None
    rows = [("mode", summary.mode), ("steps (per NN worker)", fmt_int(summary.steps)),
            ("samples (all NN workers)", fmt_int(summary.samples)),
            ("train samples/s", fmt_rate(summary.samples_per_sec)),
            ("training time", fmt_duration(summary.train_wall_s)),
            ("wall time (start-up)", f"{fmt_duration(summary.wall_s)} ({fmt_duration(start_up)})"),
            ("eval AUC", fmt_sig(summary.auc)), ("oracle AUC", fmt_sig(summary.oracle_auc)),
            ("eval logloss", fmt_sig(summary.logloss)),
            (f"progressive AUC (last {fmt_int(summary.progressive_samples)} samples)",
             fmt_sig(summary.progressive_auc)),
            ("staleness p50 / max", f"{summary.staleness.p50} / {summary.staleness.max}"),
            ("skipped batches / lost updates", f"{summary.skipped_batches} / {summary.lost_updates}"),
            ("run dir", summary.run_dir), ("report", summary.report)]
    if summary.batches_recovered or summary.updates_deduplicated:  # an embedding worker or PS restarted
        rows.insert(-2, ("recovered batches / deduplicated updates",
                         f"{fmt_int(summary.batches_recovered)} / {fmt_int(summary.updates_deduplicated)}"))
    held = fmt_int(summary.ps_rows) + (f" ({summary.ps_storage} weights)" if summary.ps_storage != "fp32" else "")
    rows.insert(-2, ("PS rows held at the end", held))
    for loss in summary.store_losses or []:  # a PS shard came back without its store: say what it cost
        rows.insert(-2, (f"[bold {'yellow' if loss.from_replica and not loss.lost else 'red'}]PS shard "
                         f"{loss.shard} lost its store[/]", loss.describe()))
    if summary.recoveries:  # processes the launcher restarted: how long each replacement took to work again
        timed = [r.seconds for r in summary.recoveries if r.seconds is not None]
        rows.insert(-2, ("restarts, back at work in", f"{len(summary.recoveries)}" + (
            f", {fmt_duration(statistics.median(timed))} (max {fmt_duration(max(timed))})" if timed else "")))
    if summary.lifecycle:  # admission or expiry did something: per table admitted / rejected / expired
        totals = [sum(getattr(t, f) for t in summary.lifecycle.values()) for f in ("admitted", "rejected", "expired")]
        rows.insert(-2, ("rows admitted / rejected / expired", " / ".join(fmt_int(n) for n in totals)))
    if summary.stream is not None:  # trained on data.stream
        st, lag = summary.stream, summary.stream.training_lag_s
        rows.insert(-2, ("stream: events / acknowledged through seq", f"{fmt_int(st.events)} / {st.acknowledged_through}"
                         + (f" (over {st.loader_restarts + 1} data loader lives)" if st.loader_restarts else "")))
        if st.skipped_messages:
            rows.insert(-2, ("stream: messages skipped (their events)",
                             f"{fmt_int(st.skipped_messages)} ({fmt_int(st.skipped_events)})"))
        if lag is not None:
            rows.insert(-2, ("training lag p50 / p99 / max", f"{fmt_duration(lag.p50)} / {fmt_duration(lag.p99)} / "
                                                             f"{fmt_duration(lag.max)}"))
    if summary.publish is not None:
        p = summary.publish
        rows.insert(-2, ("versions published / full / skipped / failed",
                         f"{p.published} / {p.full} / {p.skipped} / {p.failed} (last v{p.last_version}, "
                         f"mean {fmt_duration(p.mean_s)}) in {p.directory}"))
    for task in task_entries(summary.model_dump()):
        rows.insert(-2, task_row(task, fmt_sig))
    for key, value in rows:
        table.add_row(key, str(value))
    Console().print(table)


# The options every service of the training job takes (`serve dataloader` ... `serve embedding_ps`).
JobConfig = Annotated[Optional[Path], typer.Option("--config", help="The job's YAML config file.")]
Replica = Annotated[Optional[int], typer.Option("--replica", help="Replica index (default: $HYBRIDREC_REPLICA, "
                                                "else the hostname's trailing -N).")]
Overrides = Annotated[Optional[list[str]], typer.Option("--set", help=SET_HELP)]


def _replica(replica: Optional[int]) -> int:
    from hybridrec.core.runtime.service import default_replica

    try:
        return default_replica() if replica is None else replica
    except ValueError as exc:
        _fail(str(exc))


def _job_config(config_path: Optional[Path], overrides: Optional[list[str]], alternative: str = "") -> Config:
    if config_path is None:
        _fail(f"give --config CONFIG{alternative}")
    return _load(config_path, overrides)


def _run_service(main, usage_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Run a service's main coroutine on uvloop (the event loop every service runs); a bad config, data file or
    bundle met at start-up exits 2 naming it. A service that ends exits 0 without the interpreter's teardown."""
    import uvloop

    from hybridrec.core.layouts.bundle import BundleError

    try:
        uvloop.run(main)
    except (ConfigError, FileNotFoundError, BundleError) + usage_errors as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130)
    except asyncio.CancelledError:  # stopped (SIGTERM) while it still started: ServiceHost.start
        pass
    # Everything is closed and flushed by now. Skip interpreter teardown: native threads of
    # torch.distributed (Gloo, the TCP store) can abort the process in static destructors ("terminate called
    # without an active exception", SIGABRT), which would turn a finished NN worker into a lost one that its
    # supervisor replaces.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve_job(server, config_path: Optional[Path], replica: Optional[int], overrides: Optional[list[str]]) -> None:
    """A service of the training job (its `server` module): the job's config, this replica."""
    replica = _replica(replica)
    _run_service(server.serve(_job_config(config_path, overrides), replica))


@serve_app.command("dataloader")
def serve_dataloader(config_path: JobConfig = None, replica: Replica = None, overrides: Overrides = None):
    """Read, deduplicate and deliver the job's mini-batches."""
    from services.dataloader import server
    _serve_job(server, config_path, replica, overrides)


@serve_app.command("embedding_worker")
def serve_embedding_worker(config_path: JobConfig = None, replica: Replica = None, overrides: Overrides = None):
    """Look embeddings up in the PS shards, pool them, and route their gradients back."""
    from services.embedding_worker import server
    _serve_job(server, config_path, replica, overrides)


@serve_app.command("nn_worker")
def serve_nn_worker(config_path: JobConfig = None, replica: Replica = None, overrides: Overrides = None):
    """Train the dense network (one rank of the torch.distributed group)."""
    from services.nn_worker import server
    _serve_job(server, config_path, replica, overrides)


@serve_app.command("embedding_ps")
def serve_embedding_ps(config_path: JobConfig = None, replica: Replica = None, overrides: Overrides = None,
                       bundle: Optional[Path] = typer.Option(None, "--bundle", help="Serve shard --replica of this "
                                                             "model bundle read-only, without a config."),
                       listen: str = typer.Option("127.0.0.1:0", "--listen", help="Read-only: gRPC HOST:PORT "
                                                  "(port 0: a free one, logged as 'listening')."),
                       metrics_port: int = typer.Option(0, "--metrics-port", help="Read-only: Prometheus port "
                                                        "(0: none)."),
                       fp16: bool = typer.Option(False, "--fp16", help="Read-only: send rows kappa-scaled fp16 "
                                                 "(default float32)."),
                       tls: Optional[list[Path]] = typer.Option(None, "--tls", help="Read-only: mutual TLS, given "
                                                                "three times: --tls CA --tls CERT --tls KEY (PEM "
                                                                "files).")):
    """One shard of the embedding parameter server: the job's (--config) or a bundle's, read-only (--bundle)."""
    replica = _replica(replica)
    if bundle is None:
        from services.embedding_ps import server

        _run_service(server.serve(_job_config(config_path, overrides, " (or, read-only, --bundle BUNDLE)"),
                                  replica))
        return
    from pydantic import ValidationError

    from services.embedding_ps import readonly

    if config_path is not None or overrides:
        _fail("--bundle takes no --config or --set (the bundle says everything the read-only PS needs)")
    if tls and len(tls) != 3:
        _fail("--tls is given three times: --tls CA --tls CERT --tls KEY")
    try:
        settings = readonly.ReadOnlyPSSettings(
            bundle=bundle, replica=replica, listen=listen, metrics_port=metrics_port, fp16=fp16,
            tls=dict(zip(("ca", "cert", "key"), map(str, tls))) if tls else None)
    except ValidationError as exc:
        err = exc.errors()[0]
        _fail(f"--{'.'.join(str(p) for p in err['loc']).replace('_', '-')}: {err['msg']}")
    _run_service(readonly.serve(settings), usage_errors=(ValueError,))  # a bad bundle names its file


@serve_app.command("inference")
def serve_inference(config_path: Optional[Path] = typer.Option(None, "--config", help="Inference settings "
                                                               "(YAML, optional)."),
                    overrides: Optional[list[str]] = typer.Option(None, "--set", help="Override a setting: "
                                                                  "--set batching.max_batch_rows=64 (repeatable)."),
                    bundle: Optional[Path] = typer.Option(None, "--bundle", help="The model bundle to serve."),
                    follow: Optional[Path] = typer.Option(None, "--follow", help="A training job's versions "
                                                          "directory (publish.dir) to follow: serve the newest "
                                                          "version, swap in each new one."),
                    ps: Optional[list[str]] = typer.Option(None, "--ps", help="A read-only PS shard HOST:PORT to "
                                                           "look embeddings up in (repeatable, shard order)."),
                    engine: str = typer.Option("builtin", "--engine", help="'builtin' (Python gRPC and REST) or "
                                               "'triton' (Triton's front end on the bundle; docs/serving.md)."),
                    tritonserver: Optional[str] = typer.Option(None, "--tritonserver", help="With --engine triton: "
                                                               "the tritonserver binary (default: on PATH, else "
                                                               "the nvidia-pytriton wheel's)."),
                    tls: Optional[list[Path]] = typer.Option(None, "--tls", help="TLS on both endpoints and the "
                                                             "--ps calls, given three times: --tls CA --tls CERT "
                                                             "--tls KEY (PEM files); client certificates: "
                                                             "--set tls.require_client_cert=true.")):
    """The Open Inference Protocol (KServe v2) over gRPC and REST, for one model bundle or a job's versions."""
    from hybridrec.core.config.inference import load_inference_config
    from services.inference import server

    if tls and len(tls) != 3:
        _fail("--tls is given three times: --tls CA --tls CERT --tls KEY")
    try:
        settings = load_inference_config(config_path, overrides=overrides,
                                         values={"bundle": None if bundle is None else str(bundle),
                                                 "follow": None if follow is None else str(follow),
                                                 "ps": ps or None,
                                                 "tls": dict(zip(("ca", "cert", "key"), map(str, tls))) if tls
                                                 else None})
    except ConfigError as exc:
        _fail(str(exc))
    if engine not in ("builtin", "triton"):
        _fail(f"--engine is 'builtin' or 'triton', not {engine!r}")
    if engine == "triton":
        from services.inference import triton_server

        try:
            status = triton_server.serve(settings, tritonserver)
        except (ConfigError, RuntimeError, FileExistsError) as exc:
            _fail(str(exc))
        raise typer.Exit(status)
    if tritonserver is not None:
        _fail("--tritonserver is for --engine triton")
    _run_service(server.serve(settings))


@app.command()
def check(config_path: Path = typer.Argument(..., metavar="CONFIG", help="YAML config file."),
          overrides: Optional[list[str]] = SetOption,
          only: Optional[str] = typer.Option(None, "--only", help="Check only 'data' or only 'model'.")):
    """Check a config without starting anything: its data files and columns, and its model (built once)."""
    config = _load(config_path, overrides)
    if only not in (None, "data", "model"):
        _fail(f"--only is 'data' or 'model', not {only!r}")
    try:
        config, layout = _fit(config)
        if only is None:
            typer.echo(f"layout on this host: {layout.line()}")
        if only == "model":
            check_model(config)
        else:
            preflight(config, model=only is None)
    except ConfigError as exc:
        _fail(str(exc))
    if only != "model":
        for note in data_notes(config):
            typer.echo(f"note: {note}", err=True)
    typer.echo(f"{config_path}: {only or 'data and model'} ok")


@app.command()
def health(address: str = typer.Argument(..., help="HOST:PORT"),
           timeout: float = typer.Option(3.0, "--timeout", help="Seconds."),
           service: str = typer.Option("", "--service", help="Health service name: '' (ready) or 'liveness'.")):
    """Exit 0 iff the service at ADDRESS answers the gRPC health check with SERVING."""
    from hybridrec.core.runtime.rpc import is_serving

    ok = asyncio.run(is_serving(address, timeout_s=timeout, service=service))
    typer.echo("SERVING" if ok else "NOT_SERVING")
    raise typer.Exit(0 if ok else 1)


@data_app.command("synth")
def data_synth(out: Path = typer.Option(..., "--out", help="Output directory."),
               rows: int = typer.Option(..., "--rows", min=1, help="Training rows."),
               eval_rows: Optional[int] = typer.Option(None, "--eval-rows", min=1, help="Held-out rows."),
               seed: int = typer.Option(0, "--seed"),
               gzip: bool = typer.Option(False, "--gzip", help="Write .tsv.gz files."),
               format: str = typer.Option("tsv", "--format",
                                          help="tsv: Criteo-format files; parquet: the multi-task data set (multi-hot "
                                               "and sequence features, two correlated binary tasks, a regression "
                                               "label watch_time, a sample-weight column weight)."),
               drift_at: Optional[int] = typer.Option(None, "--drift-at", min=0, help="Plant a drift: from this training "
                                                      "row on, --drift-ids IDs (tsv: of one slot; parquet: items) "
                                                      "change their effect; the eval file is drawn after it."),
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
    started = time.monotonic()
    if format == "parquet":
        from hybridrec.app.synth_parquet import Drift as ItemDrift, synthesize_multitask

        if drift_slot is not None:
            _fail("--drift-slot: the parquet data set drifts items (item_id); a slot is for tsv")
        if ids is not None:
            _fail("--ids: for the tsv data set (its large slots); convert it with `hybridrec data to-parquet`")
        if negative_rate is not None and not 0 < negative_rate <= 1:  # NaN fails too
            _fail(f"--negative-rate: {negative_rate} is not in (0, 1]: the share of negative training rows kept")
        drift = None if drift_at is None else ItemDrift(at_row=drift_at, ids=drift_ids, shift=drift_shift)
        try:
            result = synthesize_multitask(out, rows=rows, eval_rows=eval_rows, seed=seed, drift=drift,
                                          negative_rate=negative_rate)
        except ValueError as exc:
            _fail(str(exc))
        oracles = ", ".join(f"{task} {auc:.4f}" for task, auc in result.oracle_auc.items())
        watch = result.extra["tasks"]["watch_time"]
        typer.echo(f"wrote {out} in {time.monotonic() - started:.1f} s; oracle AUC {oracles}; watch_time oracle "
                   f"RMSE {watch['oracle_rmse']:.3f} (the mean's {watch['mean_rmse']:.3f})")
        if negative_rate is not None:
            typer.echo(f"negatives down-sampled to {negative_rate:g} at weight {1 / negative_rate:g}: "
                       f"{result.extra['train_rows_written']:,} of {rows:,} training rows written")
        if drift is not None:
            _echo_drift(result.extra["drift"], drift_at, drift_shift)
        return
    if format != "tsv":
        _fail(f"--format: {format!r} is not tsv or parquet")
    if negative_rate is not None:
        _fail("--negative-rate: for the parquet data set (--format parquet), whose files have a weight column")
    from hybridrec.app.synth import Drift, synthesize

    drift = None if drift_at is None else Drift(at_row=drift_at, slot=drift_slot, ids=drift_ids, shift=drift_shift)
    try:
        summary = synthesize(out, rows=rows, eval_rows=eval_rows, seed=seed, gzip=gzip, drift=drift,
                             ids=None if ids is None else int(ids), tail_share=tail_share)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(f"wrote {out} in {time.monotonic() - started:.1f} s; oracle AUC {summary.oracle_auc:.4f}")
    if ids is not None:
        tail = summary.extra["ids"]
        typer.echo(f"about {int(ids):,} distinct IDs: {tail['head_distinct_ids']:,} planted, the rest rare IDs "
                   f"({tail['tail_share']:.1%} of the occurrences of slots {tail['tail_slots']})")
    if drift is not None:
        _echo_drift(summary.extra["drift"], drift_at, drift_shift)


def _echo_drift(planted: dict, at: int, shift: float) -> None:
    typer.echo(f"drift from row {at}: {planted['column']} IDs {', '.join(planted['ids'])} "
               f"(rows holding them: {planted['share_of_rows']:.1%}) add {shift:+g} to their logit; "
               f"probe rows in {planted['probe_file']}")


@data_app.command("replay")
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
    import asyncio

    from hybridrec.app.replay import ReplayInputError, check_files, replay
    from hybridrec.core.layouts.event_stream import split_target

    try:
        url, subject = split_target(to)
    except ValueError as exc:
        _fail(f"--to: {exc}")
    if config_path is not None and columns:
        _fail("--config and --columns: name the columns one way")
    config = _load(config_path, overrides) if config_path is not None else None
    try:  # every file, before anything is published
        checked = check_files(files, config=config,
                              columns=[c.strip() for c in columns.split(",") if c.strip()] if columns else None)
    except ReplayInputError as exc:
        _fail(str(exc))
    try:
        result = asyncio.run(replay(checked, url=url, subject=subject, stream=stream, rate=rate,
                                    rows_per_message=rows_per_message, first_event=first_event, limit=limit,
                                    partitions=partitions, retry_s=retry_s))
    except ValueError as exc:
        _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - a broker that is not there: nats-py raises several kinds
        _fail(f"--to {to}: {type(exc).__name__}: {exc}")
    kind = "" if result.format == "tsv" else " (Arrow record batches)"
    restarts = f"; {result.reconnects} reconnection{'s' if result.reconnects != 1 else ''}" if result.reconnects \
        else ""
    typer.echo(f"published {result.events:,} events ({result.first_event}..{result.first_event + result.events - 1}) "
               f"in {result.messages:,} messages{kind} to {subject}"
               f"{f' (.0 to .{partitions - 1})' if partitions > 1 else ''} in {result.seconds:.1f} s "
               f"({result.events / max(result.seconds, 1e-9):,.0f} events/s); stream {stream} ends at "
               f"{result.last_seq}{restarts}")


@data_app.command("to-parquet")
def data_to_parquet(src: Path = typer.Argument(..., help="Criteo TSV file (not gzip)."),
                    dst: Path = typer.Argument(..., help="Parquet file to write."),
                    row_group_rows: int = typer.Option(131_072, "--row-group-rows", min=1)):
    """Convert a Criteo TSV file to Parquet (the same samples: identical batches, see README "Parquet input")."""
    from hybridrec.app.parquet_data import tsv_to_parquet

    if not src.is_file():
        _fail(f"{src}: no such file")
    started = time.monotonic()
    rows = tsv_to_parquet(src, dst, row_group_rows=row_group_rows)
    typer.echo(f"wrote {rows} rows to {dst} in {time.monotonic() - started:.1f} s")


def _prepare_config(config_path: Optional[Path], overrides: Optional[list[str]], sources: list[Path]) -> Config:
    """The job's config (its features, data.format, labels, dense columns, bad_lines decide what is written), or
    without one the default Criteo features, Parquet if every source ends in .parquet."""
    if config_path is not None:
        return _load(config_path, overrides)
    from hybridrec.core.config import apply_overrides, from_dict

    parquet = [s.suffix == ".parquet" for s in sources]
    if any(parquet) and not all(parquet):
        _fail("SRC: Parquet and other files together; prepare each format on its own (or give --config)")
    fmt = "parquet" if all(parquet) else "tsv"
    tree: dict = {"data": {"train": [str(s) for s in sources], "format": fmt}}
    try:
        return from_dict(apply_overrides(tree, overrides), source="--set")
    except ConfigError as exc:
        _fail(str(exc))


@data_app.command("prepare")
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
        _fail(str(exc))
    size = sum(f.bytes for s in manifest.shards for f in s.files.values())
    typer.echo(f"wrote {out}: {len(manifest.shards)} shard(s), {manifest.rows:,} rows, {size / 2**20:.1f} MiB in "
               f"{time.monotonic() - started:.1f} s")


@data_app.command("verify")
def data_verify(directory: Path = typer.Argument(..., metavar="DIR", help="A prepared directory."),
                config_path: Optional[Path] = typer.Option(None, "--config", help="Also check that this config "
                                                           "reads the same IDs and values (its schema)."),
                overrides: Optional[list[str]] = SetOption):
    """Check a prepared directory fully: manifest, every file's size and checksum, array headers."""
    from services.dataloader import prepared

    config = _load(config_path, overrides) if config_path is not None else None
    started = time.monotonic()
    try:
        manifest = prepared.verify(directory, config)
    except ConfigError as exc:
        _fail(str(exc))
    size = sum(f.bytes for s in manifest.shards for f in s.files.values())
    typer.echo(f"ok: {directory}: {len(manifest.shards)} shard(s), {manifest.rows:,} rows, {size / 2**20:.1f} MiB "
               f"checked in {time.monotonic() - started:.1f} s")


@checkpoint_app.command("inspect")
def checkpoint_inspect(directory: Path = typer.Argument(..., help="Checkpoint directory.")):
    """Print a checkpoint's manifests."""
    from services.embedding_ps import checkpoint

    try:
        typer.echo(json.dumps(checkpoint.inspect_checkpoint(directory), indent=2))
    except (OSError, ValueError) as exc:
        _fail(str(exc))


@app.command()
def export(source: Optional[Path] = typer.Argument(None, metavar="SOURCE",
                                                   help="A finished run directory (its newest complete checkpoint) "
                                                        "or a checkpoint directory."),
           out: Optional[Path] = typer.Option(None, "--out", help="Bundle directory to create (must not exist)."),
           inspect: Optional[Path] = typer.Option(None, "--inspect", metavar="BUNDLE",
                                                  help="Verify BUNDLE and print its manifest as JSON instead."),
           triton: Optional[Path] = typer.Option(None, "--triton", metavar="REPO",
                                                 help="Also write a Triton model repository serving the bundle "
                                                      "(with SOURCE a bundle and no --out: only the repository)."),
           model_name: str = typer.Option("hybridrec", "--model-name", help="With --triton: the model's name."),
           quantize: Optional[str] = typer.Option(None, "--quantize",
                                                  help="int8: each row as int8 with a float16 scale (18 bytes a "
                                                       "row of width 16 instead of 64); read by every server and "
                                                       "by `hybridrec predict`.")):
    """Write a model bundle (dense weights + embedding rows, no optimizer state) for serving."""
    from hybridrec.core.layouts.bundle import BundleError, read_manifest, verify

    if triton is not None and source is not None and out is None:
        _triton_repository(source, triton, model_name)
        return

    if inspect is not None:
        if source is not None or out is not None:
            _fail("--inspect BUNDLE takes no SOURCE or --out")
        try:
            manifest = read_manifest(inspect)
            verify(inspect, manifest)
        except BundleError as exc:
            _fail(str(exc))
        typer.echo(json.dumps(manifest.model_dump(mode="json"), indent=2))
        return
    if source is None or out is None:
        _fail("give SOURCE and --out BUNDLE (or --inspect BUNDLE)")
    if quantize not in (None, "int8"):
        _fail(f"--quantize {quantize}: int8 is the one quantization (or leave it out: float32 rows)")
    from hybridrec.app import export as exporter

    started = time.monotonic()
    try:
        checkpoint, manifest = exporter.export(source, out, quantize=quantize)
    except (exporter.ExportError, BundleError) as exc:
        _fail(str(exc))
    except OSError as exc:  # e.g. --out on a volume the user cannot write: a message naming it, not a traceback
        _fail(f"{exc.filename or out}: {exc.strerror or exc}")
    size = sum(entry.bytes for entry in manifest.files.values())
    rows = ", ".join(f"{n:,} of width {dim}" for dim, n in sorted(manifest.rows.items()))
    typer.echo(f"wrote {out} from {checkpoint} in {time.monotonic() - started:.1f} s: step {manifest.step}, "
               f"{manifest.num_shards} shard(s), rows {rows or 'none'}"
               f"{f' ({manifest.quantization})' if manifest.quantization else ''}, {size / 2**20:.1f} MiB")
    if triton is not None:
        _triton_repository(out, triton, model_name)


def _triton_repository(bundle: Path, repo: Path, model_name: str) -> None:
    """`export --triton`: the Triton model repository of a bundle (services/inference/triton_repository.py)."""
    from hybridrec.core.layouts.bundle import BundleError
    from hybridrec.core.config.inference import load_inference_config
    from services.inference.triton_repository import write_repository

    try:
        settings = load_inference_config(None, values={"bundle": str(bundle), "model_name": model_name})
        model_dir = write_repository(bundle, repo, settings)
    except (BundleError, ConfigError, FileExistsError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{exc.filename or repo}: {exc.strerror or exc}")
    typer.echo(f"wrote the Triton model repository {repo} (model {model_dir.name}, from {bundle}); serve it with "
               f"tritonserver --model-repository {repo}, or hybridrec serve inference --engine triton --bundle "
               f"{bundle}")


@app.command()
def predict(bundle: Path = typer.Argument(..., help="A model bundle (hybridrec export)."),
            data: list[Path] = typer.Argument(..., metavar="DATA...", help="TSV, Parquet or prepared data, as "
                                              "the training job read (the bundle carries its config)."),
            out: Path = typer.Option(..., "--out", help="Output file: Parquet (.parquet) or CSV; one probability "
                                     "column per task.")):
    """Score every row of DATA offline with the same lookup and model code as `serve inference`."""
    from hybridrec.core.layouts.bundle import BundleError
    from hybridrec.app.predict import predict as run_predict

    started = time.monotonic()
    try:
        result = run_predict(bundle, [str(p) for p in data], out)
    except (BundleError, ConfigError, ValueError) as exc:  # a bundle or data that does not fit: names the file
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{exc.filename or out}: {exc.strerror or exc}")
    typer.echo(f"wrote {result.rows:,} rows of {', '.join(result.columns)} to {out} in "
               f"{time.monotonic() - started:.1f} s")


@app.command()
def plan(config_path: Optional[Path] = typer.Option(None, "--config", help="Plan this config's job on this host."),
         run_dir: Optional[Path] = typer.Option(None, "--run-dir",
                                                help="Show the plan a `hybridrec run` wrote (its plan.json)."),
         ids: Optional[float] = typer.Option(None, "--ids", help="Distinct IDs (rows) in all tables, e.g. 1e9."),
         params: Optional[float] = typer.Option(None, "--params", help="Or: embedding parameters (ids x dim)."),
         dim: int = typer.Option(16, "--dim", min=1, help="Embedding width."),
         table: Optional[list[str]] = typer.Option(None, "--table",
                                                   help="IDS:DIM, once per table (tables of their own widths), "
                                                        "e.g. --table 1e9:16 --table 2e7:64; instead of --ids."),
         optimizer: str = typer.Option(EmbeddingOptimizer.ADAGRAD.value, "--optimizer",
                                       help=" | ".join(m.value for m in EmbeddingOptimizer)),
         storage: str = typer.Option("fp32", "--storage", help="Weights: fp32 | fp16 | bf16 (ps.storage: 16-bit "
                                                                  "weights, two a word; the state stays float32)."),
         shards: int = typer.Option(2, "--shards", min=1, help="PS shards (unless --host-memory is given)."),
         host_memory: Optional[str] = typer.Option(None, "--host-memory",
                                                   help="Memory of a PS host, e.g. 12TiB: plan the fewest shards "
                                                        "and hosts that hold the tables instead of --shards."),
         changed: float = typer.Option(0.1, "--changed", min=0.0, max=1.0,
                                       help="Share of the rows an incremental checkpoint finds changed."),
         interval_s: float = typer.Option(30.0, "--interval-s", min=0.001, help="Seconds between checkpoints."),
         admit_after: int = typer.Option(1, "--admit-after", min=1, max=255,
                                         help="Occurrences before an ID gets a row (> 1: a count-min sketch)."),
         sketch_width: int = typer.Option(1 << 22, "--sketch-width", help="Sketch counters per row per store."),
         sketch_depth: int = typer.Option(4, "--sketch-depth", min=1, max=8, help="Sketch rows."),
         ttl: bool = typer.Option(False, "--ttl", help="Rows expire by age (16 bytes of stamps per row)."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Every byte a PS shard holds (store files, private arrays, a checkpoint's buffers), per shard and in total;
    what its checkpoints write; with --config, the job's plan (every replica's address and part) and the
    largest capacity this host holds; with --run-dir, the plan a run started with; with --host-memory, the
    hosts a table needs."""
    from hybridrec.app import plan as planner
    from hybridrec.app.job_plan import PLAN_FILE, JobPlan

    if run_dir is not None:
        if not (run_dir / PLAN_FILE).is_file():
            _fail(f"--run-dir {run_dir}: no {PLAN_FILE} there (a run directory of `hybridrec run` has one)")
        job = JobPlan.read(run_dir)
        typer.echo(json.dumps(job.to_json(), indent=2) if as_json else "\n".join(job.lines()))
        return
    if storage not in ("fp32", "fp16", "bf16"):
        _fail(f"--storage {storage}: one of fp32, fp16, bf16 (ps.storage)")
    try:
        if config_path is not None:
            config, layout = _fit(_load(config_path, None))
            result = planner.plan_config(config) | {"layout": layout.line(),
                                                     "job": JobPlan.of(config, layout).to_json()}
            result["largest_capacity_here"] = planner.largest_capacity(
                config, result["shards"], planner.host_memory_bytes(), planner.free_bytes(config.ps.shm_dir))
        else:
            if sum(x is not None and x != [] for x in (ids, params, table)) != 1:
                _fail("give one of --ids, --params or --table (or --config)")
            tables = [_table(t, planner) for t in table] if table else \
                [planner.Table(int(ids if ids is not None else params / dim), dim)]
            options = dict(optimizer=optimizer, admit_after=admit_after, ttl=ttl, sketch_width=sketch_width,
                           sketch_depth=sketch_depth, storage=storage)
            result = (planner.hosts_for(tables, host_bytes=_bytes(host_memory, "--host-memory"), **options)
                      if host_memory else planner.plan_tables(tables, shards=shards, **options))
        result["checkpoint"] = planner.checkpoint_bytes(result, changed=changed, interval_s=interval_s)
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    _echo_plan(result, planner)


def _echo_plan(result: dict, planner) -> None:
    from hybridrec.app.job_plan import JobPlan

    h = planner.human
    if "job" in result:
        typer.echo("\n".join(JobPlan.from_json(result["job"]).lines()))
    typer.echo(f"PS shards: {result['shards']}   optimizer: {result['optimizer']}   "
               f"weights: {result.get('storage', 'fp32')}   "
               f"rows per shard: {result['rows_per_shard']:,}")
    for name, nbytes in result["per_shard_parts"].items():
        typer.echo(f"  {name:<8} {h(nbytes):>14} per shard")
    if len(result["stores"]) > 1:
        for store in result["stores"]:
            typer.echo(f"  width {store['dim']:<4} {store['rows_per_shard']:>14,} rows "
                       f"{h(store['per_shard_bytes']):>14} per shard")
    private = result["per_shard_private"]
    typer.echo(f"store files per shard: {h(result['per_shard_bytes'])}   total: {h(result['total_bytes'])}")
    typer.echo(f"private per shard: {h(private['stamps_and_marks'])} of stamps and change marks, "
               f"{h(private['checkpoint_buffers'])} of checkpoint buffers while a dump runs"
               + (f", {h(private['disk_tier_marks'])} of the disk tier's change marks"
                  if private.get("disk_tier_marks") else ""))
    typer.echo(f"memory per shard: {h(result['per_shard_memory_bytes'])}   total: {h(result['total_memory_bytes'])}")
    if result.get("per_shard_disk_bytes"):
        typer.echo(f"disk tier per shard: {result['disk_rows_per_shard']:,} rows, {h(result['per_shard_disk_bytes'])}"
                   f" at full capacity   total: {h(result['total_disk_bytes'])}")
    if "hosts" in result:
        typer.echo(f"hosts of {h(result['host_bytes'])}: {result['hosts']:,} ({result['shards_per_host']} "
                   f"shard(s) each)")
    c = result["checkpoint"]
    typer.echo(f"checkpoints: a full dump writes {h(c['full_per_shard'])} per shard ({h(c['full_total'])} in all); "
               f"a delta of {c['changed_share']:.0%} changed rows {h(c['delta_per_shard'])} per shard, "
               f"{h(c['delta_bandwidth_per_shard'])}/s at one every {c['interval_s']:g} s")
    if "layout" in result and "job" not in result:  # the job's plan above says it
        typer.echo(f"layout on this host: {result['layout']}")
    if "largest_capacity_here" in result:
        typer.echo(f"largest ps.capacity this host holds with this layout: {result['largest_capacity_here']:,} "
                   f"rows per width per shard")


def _bytes(text: str, option: str) -> int:
    """`12TiB`, `24GB`, `1e12` as bytes (binary units for KiB..PiB, decimal for KB..PB)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
    number = text.strip().rstrip("bBiIkKmMgGtTpP")
    try:
        value = float(number) * units[text.strip()[len(number):].upper()]
    except (ValueError, KeyError):
        _fail(f"{option} {text!r}: expected a size such as 12TiB, 512GiB or 1e12")
    if value <= 0:
        _fail(f"{option} {text!r}: must be positive")
    return int(value)


def _table(spec: str, planner):
    """`--table IDS:DIM` (IDS may be written 1e9) as the planner's Table."""
    try:
        ids, dim = spec.split(":")
        return planner.Table(int(float(ids)), int(dim))
    except ValueError:
        _fail(f"--table {spec!r}: expected IDS:DIM, e.g. 1e9:16")


def main() -> None:
    from hybridrec.app.numba_seed import seed

    seed()  # in a container: the image's compiled kernels, before any is loaded
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)
