"""What `hybridrec check` and `hybridrec run` check before starting any process, in one place so that a config
and files that `check` passes are not refused by `run` before training: the config fitted to this host (the
layout), the data files and columns, the data loaders' splits, the PS shards against this host's memory, the
first rows read through the data loader's own code, and the model built once. Each refusal is a ConfigError
naming what is wrong; the CLI prints it and exits 2."""
from __future__ import annotations

from pathlib import Path

from hybridrec.core.config import Config, ConfigError


def fit_to_host(config: Config):
    """The config with its `auto` replica lists and thread count sized to this host, and the layout chosen
    (hybridrec/app/plan/layout.py); an `auto` loader count is lowered until the training data splits into that
    many parts (gzip files, Parquet row groups and prepared rows go to one loader each)."""
    from hybridrec.app.plan.layout import Host, fit

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


def check_ps_fits(config: Config) -> None:
    """A local run's PS shards all on this host: ConfigError naming it, the widths and the bytes unless their
    stores, private arrays and checkpoint buffers fit its memory and their files the free space under
    ps.shm_dir (hybridrec/app/plan/memory.py `check_fits`)."""
    import socket

    from hybridrec.app.plan import memory as planner

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
    check_ps_fits(config)
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

