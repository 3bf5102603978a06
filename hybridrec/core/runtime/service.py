"""The skeleton every hybridrec service process runs (what `hybridrec serve SERVICE` starts).

A `ServiceHost` owns the grpc.aio server, the standard health service, the
Prometheus endpoint, structured logging bound to (service, replica), and a
graceful stop on SIGTERM/SIGINT, and every thread's stack on stderr at SIGUSR2. A service's own module only builds its
servicer and says when it is ready, so the four services cannot diverge in how
they start, report health or shut down.
"""
from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import prometheus_client
from hybridrec.core.runtime import log, rpc
from hybridrec.core.config import Config, ConfigError, split_address
from hybridrec.core.wire.frames import max_request_bytes
from hybridrec.core.runtime.metrics import register_stats


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
    """Restarted with every other group member from the newest checkpoint when one of them dies (for a kind
    that `resumes_from` others: when they no longer hold the state)."""
    resumes_from: str | None = None
    """Restarted alone while the processes of this kind hold the state it continues from: an NN worker's peers
    re-form the group with the new process and hand it their state (services/nn_worker/group/membership.py); a data
    loader asks the NN workers how far they are (services/dataloader/resume.py)."""


EXIT_PEER_LOST = 75
"""Exit status of a process that stopped because a peer it cannot work without was lost, not through a fault of
its own (EX_TEMPFAIL): a supervisor restarts it, as it does one killed by a signal. Exit 1 is the process's
own failure (a bug, bad input), which restarting would only repeat."""

SERVICE_KINDS: tuple[ServiceKind, ...] = (
    ServiceKind("embedding_ps", "ps", "EmbeddingPS", restart_in_place=True),
    ServiceKind("embedding_worker", "embedding_workers", "EmbeddingWorker", restart_in_place=True),
    ServiceKind("nn_worker", "nn_workers", "NNWorker", finishes=True, restart_as_group=True,
                resumes_from="nn_worker"),
    ServiceKind("dataloader", "dataloader", "DataLoader", finishes=True, restart_as_group=True,
                resumes_from="nn_worker"),
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


def process_started_at() -> float:
    """Unix time this process started (its fork), to the kernel's 10 ms tick: /proc/self/stat's start time
    counts from boot, so it is placed against the boot clock read now."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, the 22nd field
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


_at_work: dict[str, float] = {}


def at_work(what: str) -> None:
    """Say, once per process, that this service has done its first piece of work (what `what` names: a
    training step, a lookup served, a batch delivered): logged as `at_work` with the seconds since the
    process started, which a supervisor reads as the end of a start-up or of a recovery."""
    if _at_work:
        return
    now = time.time()
    _at_work.update(at=now, start_to_work_s=now - process_started_at())
    log.get().info("at_work", what=what, start_to_work_s=round(_at_work["start_to_work_s"], 3))


def start_stats() -> dict[str, float]:
    """`start_to_work_seconds` once the process is at work (for every service's metrics)."""
    return {"start_to_work_seconds": _at_work["start_to_work_s"]} if _at_work else {}


class RemoteServer(Protocol):
    """A service's gRPC server held by another process (`ServiceHost(remote_server=...)`): an NN worker's
    receiver, through the trainer's `ReceiverLink`."""

    def add_service(self, proto_service: str, impl: Any) -> None: ...

    async def start_serving(self) -> int:
        """Serve the service's address, NOT_SERVING until `set_serving`; the port bound."""

    async def set_serving(self, serving: bool) -> None: ...


class ServiceHost:
    """Runs one replica of one service until SIGTERM or until its main task ends."""

    def __init__(self, service: str, config: Config, replica: int, remote_server: "RemoteServer | None" = None):
        """`remote_server`: the gRPC server is another process's (an NN worker's receiver:
        services/nn_worker/receiver/receiver_link.py); None: this process's own."""
        if config.cluster.sized_by_host():
            raise ConfigError(f"cluster.{config.cluster.sized_by_host()[0]}: auto is sized by `hybridrec run` "
                              f"from its host; a service started alone (hybridrec serve) needs the addresses "
                              f"listed")
        key = SERVICES[service].cluster_key
        addresses = getattr(config.cluster, key)
        if not 0 <= replica < len(addresses):
            raise ValueError(f"replica {replica} of {service} does not exist: cluster.{key} lists "
                             f"{len(addresses)} address(es)")
        self.config = config
        self._setup(service, replica, addresses[replica], bind_host=config.cluster.bind_host,
                    metrics_port=config.cluster.metrics_port, tls=config.cluster.tls,
                    control_identities=config.cluster.control_identities,
                    ps_identities=config.cluster.ps_identities, remote_server=remote_server)

    @classmethod
    def standalone(cls, service: str, *, listen: str, replica: int = 0, metrics_port: int = 0,
                   tls=None, max_receive_bytes: int | None = None,
                   max_concurrent_rpcs: int | None = None) -> "ServiceHost":
        """A replica without a training job's config (a read-only PS serving a bundle, the inference service).

        Binds `listen` (HOST:PORT; port 0 picks a free one, logged as `listening`);
        `metrics_port` 0 means no Prometheus endpoint. A service with no proto
        service of its own in protos/hybridrec.proto (inference) registers its gRPC
        services on `server` itself; health, metrics, logging and the graceful
        stop are the same as every other service's.
        """
        bind_host, _ = split_address(listen)
        host = cls.__new__(cls)
        host.config = None
        host._setup(service, replica, listen, bind_host=bind_host, metrics_port=metrics_port, tls=tls,
                    limits=(max_receive_bytes or rpc.MAX_MESSAGE_BYTES, max_concurrent_rpcs))
        return host

    def _setup(self, service: str, replica: int, address: str, *, bind_host: str, metrics_port: int, tls,
               control_identities: list[str] | None = None, ps_identities: list[str] | None = None,
               remote_server: "RemoteServer | None" = None,
               limits: tuple[int, int | None] = (rpc.MAX_MESSAGE_BYTES, None)) -> None:
        kind = SERVICES.get(service)
        self.proto_service = kind.proto_service if kind else None
        self.service, self.replica, self.address = service, replica, address
        self.bind_host, self.metrics_port = bind_host, metrics_port
        self.log = log.setup(service=service, replica=replica)
        # SIGUSR2 writes every thread's Python stack to stderr, at once and without the event loop: a service
        # whose requests wait can be read where it runs, without a debugger.
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        rpc.tune_allocator()
        rpc.use_tls(tls)
        rpc.use_authorization(control_identities, ps_identities)
        self.remote_server = remote_server
        # A job's data-plane service accepts what its largest request can be; a standalone one (inference, a
        # read-only PS) the `limits` it was started with (`standalone`): bytes a request, calls at once.
        limit, concurrent = (max_request_bytes(self.config), None) if self.config is not None else limits
        self.server = rpc.new_server(limit, concurrent) if remote_server is None else None
        self.health = rpc.add_health(self.server) if remote_server is None else None
        self.stop = asyncio.Event()
        self.metrics_address: str | None = None
        self.port: int | None = None
        self._starting: asyncio.Task | None = None

    def add(self, impl: Any, stats: Callable[[], dict[str, float]] | None = None) -> None:
        """Serve `impl`; `stats` (read at every scrape) becomes this service's Prometheus metrics."""
        if impl is not None and self.remote_server is not None:
            self.remote_server.add_service(self.proto_service, impl)
        elif impl is not None:
            rpc.add_service(self.server, self.proto_service, impl)
        if stats is not None:
            register_stats(self.service, self.replica, lambda: {**stats(), **start_stats()})

    async def start(self) -> None:
        _, port = split_address(self.address)
        if self.remote_server is not None:  # it starts NOT_SERVING, its liveness SERVING, as below
            self.port = bound = await self.remote_server.start_serving()
        else:  # NOT_SERVING until the service says it is ready (set_serving), its liveness SERVING
            self.port = bound = await rpc.start_server(self.server, self.health, self.bind_host, port)
        if self.metrics_port:
            prometheus_client.start_http_server(self.metrics_port, addr=self.bind_host)
            self.metrics_address = f"{self.bind_host}:{self.metrics_port}"
        # A stop asked for while the service still starts (waiting for its peers, restoring, loading) cancels
        # the start: nothing would look at `stop` until run_until_stopped, and a pod or a run being torn down
        # would wait for its kill. `serve` exits 0 after its cleanup, as after a stop while running.
        self._starting = asyncio.current_task()
        rpc.install_stop_handlers(self.stop, also=self._stop_while_starting)
        self.log.info("listening", port=bound, pid=os.getpid(), metrics=self.metrics_address)

    async def set_serving(self, serving: bool = True) -> None:
        """Report SERVING (or NOT_SERVING); from the first SERVING on, a kernel compiled is logged
        (`hybridrec.core.runtime.kernel_cache.watch_compiles`): every service compiles its kernels before it serves."""
        if serving:
            from hybridrec.core.runtime import kernel_cache

            kernel_cache.watch_compiles()
        if self.remote_server is not None:
            await self.remote_server.set_serving(serving)
        else:
            await rpc.set_serving(self.health, serving)
        self.log.info("serving" if serving else "not_serving")

    def _stop_while_starting(self) -> None:
        if self._starting is not None and not self._starting.done():
            self.log.warning("stopped_while_starting")
            self._starting.cancel()
            self._starting = None

    async def run_until_stopped(self, main: asyncio.Task | None = None) -> None:
        """Wait for SIGTERM (or for `main` to finish, re-raising its error), then shut down gracefully."""
        self._starting = None  # started: a stop is now this method's to handle
        stop_wait = asyncio.ensure_future(self.stop.wait())
        waiters = {stop_wait} | ({main} if main else set())
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            if main and not main.done():
                main.cancel()
                await asyncio.gather(main, return_exceptions=True)
            await self.set_serving(False)
            if self.server is not None:  # a remote server stops with its process
                await self.server.stop(grace=1.0)
            self.log.info("stopped")
        if main and main.done() and not main.cancelled() and main.exception():
            raise main.exception()
