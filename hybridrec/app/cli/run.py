"""`hybridrec run`, `hybridrec check` and `hybridrec health`: a job run locally, a config checked without
starting anything, and a service asked for its health. `run` and `check` make the same checks first
(hybridrec/app/run/preflight.py), so a config that `check` passes is not refused by `run` before training."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import typer

from hybridrec.core.config import ConfigError
from hybridrec.app.cli.common import SetOption, fail, load

commands = typer.Typer()
"""The top-level commands of this group (hybridrec/app/cli/__init__.py adds them to the app)."""


@commands.command()
def run(config_path: Path = typer.Argument(..., metavar="CONFIG", help="YAML config file."),
        overrides: Optional[list[str]] = SetOption,
        summary_json: Optional[Path] = typer.Option(None, "--summary-json", help="Write the run summary here."),
        run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Logs and results (default runs/<time>).")):
    """Start every service as a local process, train, evaluate, print a summary."""
    from hybridrec.app.run.local_run import Interrupted, RunFailed, run_job
    from hybridrec.app.report.summary_table import print_summary

    config = load(config_path, overrides)
    try:
        summary = run_job(config, run_dir, note=lambda note: typer.echo(f"hybridrec: note: {note}", err=True))
    except ConfigError as exc:
        fail(str(exc))
    except RunFailed as exc:
        fail(str(exc), code=1)
    except Interrupted:
        typer.echo("hybridrec: interrupted; every service was stopped", err=True)
        raise typer.Exit(130)
    if summary_json:
        summary.write(summary_json)
    print_summary(summary)


@commands.command()
def check(config_path: Path = typer.Argument(..., metavar="CONFIG", help="YAML config file."),
          overrides: Optional[list[str]] = SetOption,
          only: Optional[str] = typer.Option(None, "--only", help="Check only 'data' or only 'model'.")):
    """Check a config without starting anything: its data files and columns, and its model (built once)."""
    from hybridrec.app.run.preflight import check_model, data_notes, fit_to_host, preflight

    config = load(config_path, overrides)
    if only not in (None, "data", "model"):
        fail(f"--only is 'data' or 'model', not {only!r}")
    try:
        config, layout = fit_to_host(config)
        if only is None:
            typer.echo(f"layout on this host: {layout.line()}")
        if only == "model":
            check_model(config)
        else:
            preflight(config, model=only is None)
    except ConfigError as exc:
        fail(str(exc))
    if only != "model":
        for note in data_notes(config):
            typer.echo(f"note: {note}", err=True)
    typer.echo(f"{config_path}: {only or 'data and model'} ok")


@commands.command()
def health(address: str = typer.Argument(..., help="HOST:PORT"),
           timeout: float = typer.Option(3.0, "--timeout", help="Seconds."),
           service: str = typer.Option("", "--service", help="Health service name: '' (ready) or 'liveness'.")):
    """Exit 0 iff the service at ADDRESS answers the gRPC health check with SERVING."""
    from hybridrec.core.runtime.rpc import is_serving

    ok = asyncio.run(is_serving(address, timeout_s=timeout, service=service))
    typer.echo("SERVING" if ok else "NOT_SERVING")
    raise typer.Exit(0 if ok else 1)
