"""`hybridrec serve NAME`: one service in this process, what a container runs. The four services of the
training job take the job's config and their replica index; the embedding PS also serves a bundle read-only,
and the inference service takes its own settings (hybridrec/core/config/inference.py). A bad config, data file
or bundle met at start-up exits 2 naming it."""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from hybridrec.core.config import Config, ConfigError
from hybridrec.app.cli.common import SET_HELP, fail, load

group = typer.Typer(no_args_is_help=True, help="Run one service in this process (what a container runs).")

# The options every service of the training job takes (`serve dataloader` ... `serve embedding_ps`).
JobConfig = Annotated[Optional[Path], typer.Option("--config", help="The job's YAML config file.")]
Replica = Annotated[Optional[int], typer.Option("--replica", help="Replica index (default: $HYBRIDREC_REPLICA, "
                                                "else the hostname's trailing -N).")]
Overrides = Annotated[Optional[list[str]], typer.Option("--set", help=SET_HELP)]
TLS_THRICE = "--tls is given three times: --tls CA --tls CERT --tls KEY"


def _replica(replica: Optional[int]) -> int:
    from hybridrec.core.runtime.service import default_replica

    try:
        return default_replica() if replica is None else replica
    except ValueError as exc:
        fail(str(exc))


def _job_config(config_path: Optional[Path], overrides: Optional[list[str]], alternative: str = "") -> Config:
    if config_path is None:
        fail(f"give --config CONFIG{alternative}")
    return load(config_path, overrides)


def _tls(tls: Optional[list[Path]]) -> Optional[dict[str, str]]:
    """`--tls CA --tls CERT --tls KEY` as the settings' tls section (None without --tls)."""
    if tls and len(tls) != 3:
        fail(TLS_THRICE)
    return dict(zip(("ca", "cert", "key"), map(str, tls))) if tls else None


def _run_service(main, usage_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Run a service's main coroutine on uvloop (the event loop every service runs); a bad config, data file or
    bundle met at start-up exits 2 naming it. A service that ends exits 0 without the interpreter's teardown."""
    import uvloop

    from hybridrec.core.layouts.bundle import BundleError

    try:
        uvloop.run(main)
    except (ConfigError, FileNotFoundError, BundleError) + usage_errors as exc:
        fail(str(exc))
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



@group.command("dataloader")
def serve_dataloader(config_path: JobConfig = None, replica: Replica = None, overrides: Overrides = None):
    """Read, deduplicate and deliver the job's mini-batches."""
    from services.dataloader import server
    _serve_job(server, config_path, replica, overrides)


@group.command("embedding_worker")
def serve_embedding_worker(config_path: JobConfig = None, replica: Replica = None, overrides: Overrides = None):
    """Look embeddings up in the PS shards, pool them, and route their gradients back."""
    from services.embedding_worker import server
    _serve_job(server, config_path, replica, overrides)


@group.command("nn_worker")
def serve_nn_worker(config_path: JobConfig = None, replica: Replica = None, overrides: Overrides = None):
    """Train the dense network (one rank of the torch.distributed group)."""
    from services.nn_worker import server
    _serve_job(server, config_path, replica, overrides)


@group.command("embedding_ps")
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
    if config_path is not None or overrides:
        fail("--bundle takes no --config or --set (the bundle says everything the read-only PS needs)")
    from services.embedding_ps import readonly

    settings = _readonly_settings(bundle=bundle, replica=replica, listen=listen, metrics_port=metrics_port,
                                  fp16=fp16, tls=_tls(tls))
    _run_service(readonly.serve(settings), usage_errors=(ValueError,))  # a bad bundle names its file


def _readonly_settings(**values):
    """The read-only PS's settings from its options; a bad one exits 2 naming the option."""
    from pydantic import ValidationError

    from services.embedding_ps import readonly

    try:
        return readonly.ReadOnlyPSSettings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        fail(f"--{'.'.join(str(p) for p in err['loc']).replace('_', '-')}: {err['msg']}")


@group.command("inference")
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
    from services.inference import server

    settings = _inference_settings(config_path, overrides, bundle=None if bundle is None else str(bundle),
                                   follow=None if follow is None else str(follow), ps=ps or None, tls=_tls(tls))
    if engine not in ("builtin", "triton"):
        fail(f"--engine is 'builtin' or 'triton', not {engine!r}")
    if engine == "triton":
        _serve_triton(settings, tritonserver)
    if tritonserver is not None:
        fail("--tritonserver is for --engine triton")
    _run_service(server.serve(settings))


def _inference_settings(config_path: Optional[Path], overrides: Optional[list[str]], **values):
    """The inference settings: the YAML file, its --set overrides and the options given (values)."""
    from hybridrec.core.config.inference import load_inference_config

    try:
        return load_inference_config(config_path, overrides=overrides, values=values)
    except ConfigError as exc:
        fail(str(exc))


def _serve_triton(settings, tritonserver: Optional[str]) -> None:
    """`--engine triton`: Triton's front end on the bundle; exits with its status."""
    from services.inference import triton_server

    try:
        status = triton_server.serve(settings, tritonserver)
    except (ConfigError, RuntimeError, FileExistsError) as exc:
        fail(str(exc))
    raise typer.Exit(status)
