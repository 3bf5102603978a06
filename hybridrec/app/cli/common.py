"""What every command group of the CLI shares: how a user's mistake ends a command (one line on stderr,
`hybridrec: error: ...`, exit 2; a failed run exits 1), loading the config a command is given, and the
`--set` option."""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn, Optional

import typer

from hybridrec.core.config import Config, ConfigError, load_config

EXIT_USAGE = 2

SET_HELP = "Override a config key: --set training.epochs=2 (repeatable)."
SetOption = typer.Option(None, "--set", help=SET_HELP)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print `message` as the command's error and exit with `code` (2: the user's mistake)."""
    typer.echo(f"hybridrec: error: {message}", err=True)
    raise typer.Exit(code)


def load(path: Path, overrides: Optional[list[str]]) -> Config:
    """The config at `path` with its `--set` overrides, or a failed command naming what is wrong."""
    try:
        return load_config(path, overrides or [])
    except ConfigError as exc:
        fail(str(exc))


def os_error(exc: OSError, path: Path) -> str:
    """A file the command could not write or read, named: its own file name or `path`, and why."""
    return f"{exc.filename or path}: {exc.strerror or exc}"
