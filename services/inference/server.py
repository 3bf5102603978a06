"""`hybridrec serve inference --bundle DIR` (or `--follow VERSIONS_DIR`): the inference service's process.

Live at once (grpc.health.v1 "liveness", ServerLive, /v2/health/live); the
bundle is loaded next and only then do ServerReady, ModelReady, the overall
grpc.health.v1 status and /v2/health/ready turn ready.
"""
from __future__ import annotations

import asyncio
import functools
import time

import torch
from aiohttp import web

from hybridrec.core.runtime import rpc
from hybridrec.core.layouts.bundle import read_manifest
from hybridrec.core.config.inference import InferenceConfig, request_bytes
from hybridrec.core.runtime.service import ServiceHost
from services.inference.batcher import Batcher
from services.inference.compiled import warm_up as compiled_warm_up
from services.inference.core import InferenceCore
from services.inference.follow import FollowSource, inference_model
from services.inference.grpc_api import GRPCInferenceServicer, add_to_server
from services.inference.model import RemotePSTable, StaticSource, load_model
from services.inference.rest import make_app, ssl_context
from services.inference.warm_up import warm_up


async def serve(settings: InferenceConfig) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    if settings.bundle is not None:
        read_manifest(settings.bundle)  # not a bundle: say so before binding anything
    host = ServiceHost.standalone("inference", listen=f"{settings.host}:{settings.grpc_port}",
                                  metrics_port=settings.metrics_port, tls=settings.tls,
                                  max_receive_bytes=request_bytes(settings),
                                  max_concurrent_rpcs=settings.max_concurrent_requests)
    core = InferenceCore(settings.model_name, settings.max_request_rows)
    add_to_server(host.server, GRPCInferenceServicer(core))
    host.add(None, stats=core.stats)
    await host.start()
    runner = None
    http_port = None
    if settings.http_port is not None:
        runner = web.AppRunner(make_app(core, max_body_bytes=request_bytes(settings),
                                        max_concurrent=settings.max_concurrent_requests,
                                        read_timeout_s=settings.http_read_timeout_s),
                               access_log=None, keepalive_timeout=settings.http_idle_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.http_port,
                           ssl_context=ssl_context(settings.tls) if settings.tls is not None else None)
        await site.start()
        http_port = runner.addresses[0][1]
    host.log.info("endpoints", grpc_port=host.port, http_port=http_port,
                  tls=None if settings.tls is None else "client certificate required"
                  if settings.tls.require_client_cert else "server certificate")

    table = None
    if settings.ps:  # ready only once every shard answers: a shard still verifying its bundle is not SERVING
        await rpc.wait_until_serving(settings.ps, timeout_s=settings.ps_start_timeout_s, what="read-only PS shards")
        table = RemotePSTable(settings.ps, timeout_s=settings.ps_timeout_s, kappa=settings.ps_kappa)
    loop = asyncio.get_running_loop()
    follow = None
    try:
        if settings.follow is not None:  # live versions: the newest one, swapped in as they are published
            follow = FollowSource(settings.follow, poll_s=settings.follow_poll_s, check=settings.verify_bundle,
                                  make_model=functools.partial(inference_model, compile=settings.compile_dense),
                                  warm_up=compiled_warm_up if settings.compile_dense else None)
            host.add(None, stats=follow.stats)
            await loop.run_in_executor(None, follow.start, settings.follow_wait_s)
            source = follow
        else:
            source = StaticSource(await loop.run_in_executor(None, lambda: load_model(
                settings.bundle, table=table, check=settings.verify_bundle, compile=settings.compile_dense)))
    except BaseException:  # nothing to serve: close what is open, then report (exit 2 from the CLI)
        if follow is not None:
            await loop.run_in_executor(None, follow.stop)
        if table is not None:
            await table.close()
        if runner is not None:
            await runner.cleanup()
        await host.server.stop(grace=None)
        raise
    model = source.current()
    batcher = Batcher(source, settings.batching)
    # every kernel a request reaches, compiled before the model is ready; then any other compilation is logged
    warm_started = time.monotonic()
    probes = await warm_up(model, batcher, settings.model_name, settings.max_request_rows)
    batcher.start()
    core.serve(batcher.source, batcher)
    host.log.info("model_loaded", bundle=settings.bundle, follow=settings.follow, version=model.version,
                  step=model.step, embeddings="ps" if settings.ps else "local", outputs=model.outputs,
                  warm_up_requests=probes, warm_up_s=round(time.monotonic() - warm_started, 3))
    await host.set_serving(True)
    try:
        await host.run_until_stopped()
    finally:
        if follow is not None:
            await loop.run_in_executor(None, follow.stop)
        await batcher.close()
        if table is not None:
            await table.close()
        if runner is not None:
            await runner.cleanup()
