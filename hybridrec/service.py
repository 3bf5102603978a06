"""The skeleton every hybridrec service process runs (what `hybridrec serve SERVICE` starts).

A `ServiceHost` owns the grpc.aio server, the standard health service, the
Prometheus endpoint, structured logging bound to (service, replica), and a
graceful stop on SIGTERM/SIGINT. A service's own module only builds its
servicer and says when it is ready, so the four services cannot diverge in how
they start, report health or shut down.
"""
from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import prometheus_client
from grpc_health.v1 import health_pb2

from hybridrec import log, rpc
from hybridrec.config import Config, split_address
from hybridrec.metrics import register_stats

LIVENESS = "liveness"



@dataclass(frozen=True)
class ServiceKind:
    """One kind of service: where its replicas are configured, what it serves, how `hybridrec run` treats it."""

    name: str
    """`hybridrec serve NAME`; its code is the package services/NAME."""
    cluster_key: str
    """The `cluster` config key listing its replicas' addresses."""
    proto_service: str
    """Its gRPC service in protos/hybridrec.proto."""
    finishes: bool = False
    """Exits 0 when its work is done: the launcher counts that as finished, not failed."""
    restart_in_place: bool = False
    """Restarted alone when it dies, like a container (its state is in shm, or it has none)."""
    restart_as_group: bool = False
    """Restarted with every other group member from the newest checkpoint when one of them dies."""


SERVICE_KINDS: tuple[ServiceKind, ...] = (
    ServiceKind("embedding_ps", "ps", "EmbeddingPS", restart_in_place=True),
    ServiceKind("embedding_worker", "embedding_workers", "EmbeddingWorker", restart_in_place=True),
    ServiceKind("nn_worker", "nn_workers", "NNWorker", finishes=True, restart_as_group=True),
    ServiceKind("dataloader", "dataloader", "DataLoader", finishes=True, restart_as_group=True),
)
"""Every service, in the order `hybridrec run` starts them (servers before their clients)."""
SERVICES: dict[str, ServiceKind] = {kind.name: kind for kind in SERVICE_KINDS}


def default_replica() -> int:
    """HYBRIDREC_REPLICA, else the trailing -N of the hostname (StatefulSet pods: ps-1 -> 1), else 0."""
    env = os.environ.get("HYBRIDREC_REPLICA")
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"HYBRIDREC_REPLICA must be a non-negative integer, got {env!r}")
        return int(env)
    tail = socket.gethostname().rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class ServiceHost:
    """Runs one replica of one service until SIGTERM or until its main task ends."""

    def __init__(self, service: str, config: Config, replica: int):
        kind = SERVICES[service]
        key, self.proto_service = kind.cluster_key, kind.proto_service
        addresses = getattr(config.cluster, key)
        if not 0 <= replica < len(addresses):
            raise ValueError(f"replica {replica} of {service} does not exist: cluster.{key} lists "
                             f"{len(addresses)} address(es)")
        self.service, self.config, self.replica = service, config, replica
        self.address = addresses[replica]
        self.log = log.setup(service=service, replica=replica)
        rpc.use_tls(config.cluster.tls)
        rpc.use_authorization(config.cluster.control_identities)
        self.server = rpc.new_server()
        self.health = rpc.add_health(self.server)
        self.stop = asyncio.Event()
        self.metrics_address: str | None = None

    def add(self, impl: Any, stats: Callable[[], dict[str, float]] | None = None) -> None:
        """Serve `impl`; `stats` (read at every scrape) becomes this service's Prometheus metrics."""
        rpc.add_service(self.server, self.proto_service, impl)
        if stats is not None:
            register_stats(self.service, self.replica, stats)

    async def start(self) -> None:
        _, port = split_address(self.address)
        bound = rpc.bind(self.server, self.config.cluster.bind_host, port)
        await self.server.start()
        if self.config.cluster.metrics_port:
            prometheus_client.start_http_server(self.config.cluster.metrics_port, addr=self.config.cluster.bind_host)
            self.metrics_address = f"{self.config.cluster.bind_host}:{self.config.cluster.metrics_port}"
        rpc.install_stop_handlers(self.stop)
        # "liveness": SERVING while the process runs, for liveness probes; "" (the overall status)
        # turns SERVING only once the service's dependencies answer, for readiness.
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self.log.info("listening", port=bound, pid=os.getpid(), metrics=self.metrics_address)

    async def set_serving(self, serving: bool = True) -> None:
        await rpc.set_serving(self.health, serving)
        self.log.info("serving" if serving else "not_serving")

    async def run_until_stopped(self, main: asyncio.Task | None = None) -> None:
        """Wait for SIGTERM (or for `main` to finish, re-raising its error), then shut down gracefully."""
        stop_wait = asyncio.ensure_future(self.stop.wait())
        waiters = {stop_wait} | ({main} if main else set())
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            if main and not main.done():
                main.cancel()
                await asyncio.gather(main, return_exceptions=True)
            await rpc.set_serving(self.health, False)
            await self.server.stop(grace=1.0)
            self.log.info("stopped")
        if main and main.done() and not main.cancelled() and main.exception():
            raise main.exception()
