"""`hybridrec export`, `hybridrec predict` and `hybridrec checkpoint inspect`: a trained model taken out of a
job. Export writes a bundle (hybridrec/app/model/export.py) and, with --triton, a Triton model repository
(services/inference/triton_repository.py); predict scores files offline with a bundle
(hybridrec/app/model/predict.py); inspect prints a checkpoint's manifests."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from hybridrec.core.config import ConfigError
from hybridrec.app.cli.common import fail, os_error

commands = typer.Typer()
"""The top-level commands of this group (hybridrec/app/cli/__init__.py adds them to the app)."""
checkpoint_group = typer.Typer(no_args_is_help=True, help="Checkpoints.")


@checkpoint_group.command("inspect")
def checkpoint_inspect(directory: Path = typer.Argument(..., help="Checkpoint directory.")):
    """Print a checkpoint's manifests."""
    from services.embedding_ps import checkpoint

    try:
        typer.echo(json.dumps(checkpoint.inspect_checkpoint(directory), indent=2))
    except (OSError, ValueError) as exc:
        fail(str(exc))


@commands.command()
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
    if triton is not None and source is not None and out is None:
        _triton_repository(source, triton, model_name)
        return
    if inspect is not None:
        if source is not None or out is not None:
            fail("--inspect BUNDLE takes no SOURCE or --out")
        _inspect(inspect)
        return
    if source is None or out is None:
        fail("give SOURCE and --out BUNDLE (or --inspect BUNDLE)")
    if quantize not in (None, "int8"):
        fail(f"--quantize {quantize}: int8 is the one quantization (or leave it out: float32 rows)")
    _export(source, out, quantize)
    if triton is not None:
        _triton_repository(out, triton, model_name)


def _inspect(bundle: Path) -> None:
    """`export --inspect BUNDLE`: verify the bundle, print its manifest as JSON."""
    from hybridrec.core.layouts.bundle import BundleError, read_manifest, verify

    try:
        manifest = read_manifest(bundle)
        verify(bundle, manifest)
    except BundleError as exc:
        fail(str(exc))
    typer.echo(json.dumps(manifest.model_dump(mode="json"), indent=2))


def _export(source: Path, out: Path, quantize: Optional[str]) -> None:
    """`export SOURCE --out BUNDLE`: the bundle written, and what it holds."""
    from hybridrec.core.layouts.bundle import BundleError
    from hybridrec.app.model import export as exporter

    started = time.monotonic()
    try:
        read_from, manifest = exporter.export(source, out, quantize=quantize)
    except (exporter.ExportError, BundleError) as exc:
        fail(str(exc))
    except OSError as exc:  # e.g. --out on a volume the user cannot write: a message naming it, not a traceback
        fail(os_error(exc, out))
    typer.echo(exporter.describe(out, read_from, manifest, time.monotonic() - started))


def _triton_repository(bundle: Path, repo: Path, model_name: str) -> None:
    """`export --triton`: the Triton model repository of a bundle (services/inference/triton_repository.py)."""
    from hybridrec.core.layouts.bundle import BundleError
    from hybridrec.core.config.inference import load_inference_config
    from services.inference.triton_repository import write_repository

    try:
        settings = load_inference_config(None, values={"bundle": str(bundle), "model_name": model_name})
        model_dir = write_repository(bundle, repo, settings)
    except (BundleError, ConfigError, FileExistsError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(os_error(exc, repo))
    typer.echo(f"wrote the Triton model repository {repo} (model {model_dir.name}, from {bundle}); serve it with "
               f"tritonserver --model-repository {repo}, or hybridrec serve inference --engine triton --bundle "
               f"{bundle}")


@commands.command()
def predict(bundle: Path = typer.Argument(..., help="A model bundle (hybridrec export)."),
            data: list[Path] = typer.Argument(..., metavar="DATA...", help="TSV, Parquet or prepared data, as "
                                              "the training job read (the bundle carries its config)."),
            out: Path = typer.Option(..., "--out", help="Output file: Parquet (.parquet) or CSV; one probability "
                                     "column per task.")):
    """Score every row of DATA offline with the same lookup and model code as `serve inference`."""
    from hybridrec.core.layouts.bundle import BundleError
    from hybridrec.app.model.predict import predict as run_predict

    started = time.monotonic()
    try:
        result = run_predict(bundle, [str(p) for p in data], out)
    except (BundleError, ConfigError, ValueError) as exc:  # a bundle or data that does not fit: names the file
        fail(str(exc))
    except OSError as exc:
        fail(os_error(exc, out))
    typer.echo(f"wrote {result.rows:,} rows of {', '.join(result.columns)} to {out} in "
               f"{time.monotonic() - started:.1f} s")
