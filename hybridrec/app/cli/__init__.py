"""The `hybridrec` command: run, check, health (run.py), serve NAME (serve.py), data (data.py), export, predict,
checkpoint (model.py) and plan (plan.py). Each command checks its options and calls the module that does the
work; this package only builds the app from the groups and starts it (`main`, the console entry point and
`python -m hybridrec`).

User mistakes (bad config key, missing data file, model path that does not
import) print one clear message and exit with code 2 — no traceback wall.
A failed run exits 1, Ctrl-C exits 130.

This is the app layer (hybridrec/app/): it imports the services with plain
import statements, inside the commands that run them, so `hybridrec --help`
starts without loading torch or any service. The core library (hybridrec/core/)
and the services never import it (tests/unit/test_layering.py checks the graph).
"""
from __future__ import annotations

import sys

import typer

from hybridrec.app.cli import data, model, plan, run, serve

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Hybrid sync/async training of recommender models with a sharded embedding PS.")
for _group in (run, model, plan):  # top-level commands, listed by --help in this order
    app.registered_commands += _group.commands.registered_commands
app.add_typer(data.group, name="data")
app.add_typer(model.checkpoint_group, name="checkpoint")
app.add_typer(serve.group, name="serve")


def main() -> None:
    from hybridrec.app.run.numba_seed import seed

    seed()  # in a container: the image's compiled kernels, before any is loaded
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)
