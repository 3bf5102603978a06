"""gRPC plumbing shared by the four services: servers, channels, raw-bytes methods, health.

Services are registered from the service descriptors of protos/hybridrec.proto:
a method whose request type is `Frame` is a data-plane method and gets identity
(de)serializers, so the handler receives and returns the raw frame bytes and
protobuf never touches a tensor. Every handler runs inside `guard`, which turns
a bad request into INVALID_ARGUMENT (a missing batch into NOT_FOUND, a request the
server never accepts in its state, e.g. an update to a read-only PS, into
FAILED_PRECONDITION) with a
readable detail, so hostile input never takes a server down.
"""
from __future__ import annotations

import asyncio
import ctypes
import enum
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hybridrec.core.runtime import log
from hybridrec.core.runtime.metrics import REFUSED, RPC_LATENCY
from hybridrec.core.wire.proto import pb

MAX_MESSAGE_BYTES = 1 << 30
# Embedding frames are megabytes: large HTTP/2 frames and a large flow-control window
# let one message go out without waiting for window updates. On loopback this made no
# measurable difference (docs/architecture.md#what-a-large-frame-costs); across a network
# with a longer round trip the window is what keeps a large frame moving.
HTTP2_OPTIONS = [
    ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ("grpc.http2.initial_window_size", 64 * 1024 * 1024),
]
CHANNEL_OPTIONS = [*HTTP2_OPTIONS,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 0),
    # One TCP connection per channel even when several channels target the same address.
    ("grpc.use_local_subchannel_pool", 1),
    # A lost peer is tried again after 0.1 s, then less and less often, but at least every second (gRPC's
    # own backoff starts at 1 s and grows to two minutes): a restarted service is reached within a second of
    # listening, not after a backoff that grew while it was down.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS = [*HTTP2_OPTIONS,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
FRAME = pb.DESCRIPTOR.message_types_by_name["Frame"]

# glibc malloc settings for processes that move megabyte frames (tune_allocator).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Allocations below this come from the heap, not from a fresh mmap (glibc's largest allowed value)."""
MALLOC_TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
"""Free memory at the top of the heap kept for reuse rather than handed back to the kernel."""


def tune_allocator() -> bool:
    """Keep megabyte frame buffers on the malloc heap, reused from one message to the next.

    grpcio's Python layer turns each received message into a new bytes object
    (one per received slice, then a join) and copies each sent one into a new
    slice. With glibc's default, adaptive thresholds a 4 MB buffer is often
    mmap'd and unmapped again, or the heap trimmed after it, so every message
    pays a page fault per 4 kB page, which more than doubled the receiving
    process's CPU time per frame in benchmarks/codec.py
    (docs/architecture.md#what-a-large-frame-costs). Fixed thresholds stop
    that. Returns False where the C library has no mallopt (not glibc).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD_BYTES))


class NotFound(LookupError):
    """The request names something this server does not hold (e.g. an unknown batch_ref)."""


class Unavailable(RuntimeError):
    """The server cannot serve this now (a dependency is down); the caller may retry."""


class FailedPrecondition(RuntimeError):
    """The server does not do this in its state (e.g. a read-only PS asked to update, a PS asked for a delta on a
    version it did not publish last); retrying the same request will not help."""


def guard(fn: Callable[..., Awaitable[Any]], service: str, method: str) -> Callable[..., Awaitable[Any]]:
    """`fn` as a gRPC handler: user errors become status codes with their message, a bug INTERNAL, never a
    dead server; latency observed, control and PS-peer methods authorised (`ROLES`)."""
    latency = RPC_LATENCY.labels(service, method)

    role = role_of(service, method)

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            if role is not Role.DATA:
                authorize(context, f"{service}.{method}", role)
            return await fn(request, context)
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the server (status_of logs it)
            code, detail = status_of(exc, service, method)
        finally:
            latency.observe(time.perf_counter() - started)
        await context.abort(code, detail)

    return handler


def status_of(exc: Exception, service: str, method: str) -> tuple[grpc.StatusCode, str]:
    """The status a handler's exception answers its call with, and the detail (at most 2,000 characters): a
    user's error its code and message, a refusal logged and counted, anything else a bug, INTERNAL, logged
    with its trace (call it inside the `except`)."""
    if isinstance(exc, ValueError):  # includes codec.FrameError
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, PermissionError):  # a path outside the service's root, a caller not authorised
        code = grpc.StatusCode.PERMISSION_DENIED
        log.get().warning("rpc_refused", method=method, reason=str(exc))
        REFUSED.labels(service, method).inc()
    elif isinstance(exc, NotFound):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, Unavailable):
        code = grpc.StatusCode.UNAVAILABLE
    elif isinstance(exc, FailedPrecondition):
        code = grpc.StatusCode.FAILED_PRECONDITION
    else:
        log.get().exception("rpc_failed", method=method)
        return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"[:2000]
    return code, str(exc)[:2000]


def add_service(server: grpc.aio.Server, service_name: str, impl: Any) -> None:
    """Register `impl`'s coroutine methods for every method of the proto service `service_name`."""
    service = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        fn = getattr(impl, method.name)
        if method.input_type is FRAME:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(guard(fn, service_name, method.name))
        else:
            request_cls = getattr(pb, method.input_type.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                guard(fn, service_name, method.name),
                request_deserializer=request_cls.FromString,
                response_serializer=lambda msg: msg.SerializeToString(),
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def raw_method(channel: grpc.aio.Channel, service_name: str, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    """A bytes-in, bytes-out callable for a data-plane method."""
    return channel.unary_unary(f"/hybridrec.{service_name}/{method}")


def control_method(channel: grpc.aio.Channel, service_name: str, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    """A protobuf callable for a control method."""
    descriptor = pb.DESCRIPTOR.services_by_name[service_name].methods_by_name[method]
    return channel.unary_unary(
        f"/hybridrec.{service_name}/{method}",
        request_serializer=lambda msg: msg.SerializeToString(),
        response_deserializer=getattr(pb, descriptor.output_type.name).FromString,
    )


@dataclass(frozen=True)
class Security:
    """PEM bytes for TLS; None in `_security` means plaintext channels."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str | None = None
    require_client_auth: bool = True
    """Servers refuse a client without a certificate signed by `ca` (always, between a job's services; the
    inference service's endpoints only with `tls.require_client_cert`)."""

    @classmethod
    def from_config(cls, tls) -> "Security":
        def read(path: str, what: str) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"cluster.tls.{what}: cannot read {path}: {exc.strerror}") from None

        return cls(read(tls.ca, "ca"), read(tls.cert, "cert"), read(tls.key, "key"), tls.server_name,
                   require_client_auth=getattr(tls, "require_client_cert", True))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


class Role(str, enum.Enum):
    """Who may call a method, by mutual-TLS identity."""

    DATA = "data"
    """The data plane and what reads a service's state: any certificate the CA signed."""
    PEER = "peer"
    """PS to PS (`ps.replicas: 2`): only the PS identities (`cluster.ps_identities`), and each method's handler
    narrows it to the one PS that may call it."""
    CONTROL = "control"
    """Methods that change a service's state outside training's data path (they write or replace tables): only
    `cluster.control_identities`."""


ROLES: dict[str, dict[str, Role]] = {
    "EmbeddingPS": {"Lookup": Role.DATA, "Update": Role.DATA, "Stats": Role.DATA, "Checkpoint": Role.CONTROL,
                    "LoadCheckpoint": Role.CONTROL, "Publish": Role.CONTROL, "Replicate": Role.PEER,
                    "PullShard": Role.PEER},
    "EmbeddingWorker": {"PutBatch": Role.DATA, "Lookup": Role.DATA, "PushGradients": Role.DATA, "Stats": Role.DATA},
    "NNWorker": {"PutBatch": Role.DATA, "Received": Role.DATA, "Status": Role.DATA, "Stats": Role.DATA},
    "DataLoader": {"Stats": Role.DATA},
    "inference": {"ServerLive": Role.DATA, "ServerReady": Role.DATA, "ModelReady": Role.DATA,
                  "ServerMetadata": Role.DATA, "ModelMetadata": Role.DATA, "ModelInfer": Role.DATA},
}
"""Every method of every service and its role, by the name the service registers its handlers under (`guard`:
protos/hybridrec.proto's service names; the Open Inference Protocol's GRPCInferenceService as "inference"). A test
walks the descriptors: none is left out, and a method without a role cannot be registered. (The standard
health service answers whoever reaches the port, as README's Security section says.)"""
_identities: dict[Role, frozenset[str] | None] = {Role.CONTROL: None, Role.PEER: None}


def role_of(service: str, method: str) -> Role:
    try:
        return ROLES[service][method]
    except KeyError:
        raise KeyError(f"{service}.{method} has no role in hybridrec.core.runtime.rpc.ROLES") from None


def use_authorization(identities: list[str] | None, ps_identities: list[str] | None = None) -> None:
    """Allow control methods only to peers whose certificate names one of `identities`, and PS-peer methods only
    to the PS identities (None: any peer)."""
    _identities[Role.CONTROL] = frozenset(identities) if identities is not None else None
    _identities[Role.PEER] = frozenset(ps_identities) if ps_identities is not None else None


def peer_identities(context: grpc.aio.ServicerContext) -> set[str]:
    """The caller's certificate subject common name and subject alternative names (empty without mTLS)."""
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name", []) + auth.get("x509_subject_alternative_name", [])
    return {n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names}


_ROLE_KEYS = {Role.CONTROL: "cluster.control_identities", Role.PEER: "cluster.ps_identities"}


def authorize(context: grpc.aio.ServicerContext, what: str, role: Role = Role.CONTROL) -> None:
    """PermissionError unless the caller may use method `what` of `role`."""
    allowed = _identities.get(role)
    if allowed is None:
        return
    caller = peer_identities(context)
    if not caller & allowed:
        who = ", ".join(sorted(caller)) or "no certificate"
        raise PermissionError(f"{what} is a {role.value} method; the caller ({who}) is not one of "
                              f"{_ROLE_KEYS[role]}")


def require_caller(context: grpc.aio.ServicerContext, identity: str | None, what: str) -> None:
    """PermissionError unless the caller's certificate names `identity` (None: not checked): one PS of
    `cluster.ps_identities`, the only one that may make this call."""
    if identity is None or _identities[Role.PEER] is None:
        return
    caller = peer_identities(context)
    if identity not in caller:
        who = ", ".join(sorted(caller)) or "no certificate"
        raise PermissionError(f"{what}: only {identity} (cluster.ps_identities) may call it, not {who}")


# One process talks to every peer the same way, so the choice is made once at start-up
# (`use_tls`) rather than threaded through every call site.
_security: Security | None = None


def use_tls(tls) -> None:
    """Make every channel and server of this process use mutual TLS (tls: config.TLSConfig or None; the
    inference service's ServingTLSConfig may leave its servers' client certificates optional)."""
    global _security
    _security = Security.from_config(tls) if tls is not None else None


def channel(address: str, *, reconnect_ms: int | None = None) -> grpc.aio.Channel:
    """An asyncio channel, secured like the rest. `reconnect_ms`: retry a lost connection at least this often
    (gRPC's own backoff grows to two minutes)."""
    options = CHANNEL_OPTIONS
    if reconnect_ms is not None:
        backoff = ("grpc.initial_reconnect_backoff_ms", "grpc.min_reconnect_backoff_ms", "grpc.max_reconnect_backoff_ms")
        options = [o for o in options if o[0] not in backoff] + [(key, reconnect_ms) for key in backoff]
    if _security is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, _security.channel_credentials(),
                                   options=options + _security.channel_options())


def sync_channel(address: str) -> grpc.Channel:
    """A blocking channel (the launcher's status polls, a PS copying its backup before it serves), secured and
    sized like the rest."""
    if _security is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, _security.channel_credentials(),
                               options=CHANNEL_OPTIONS + _security.channel_options())


def training_status(address: str, timeout_s: float = 1.0) -> pb.TrainingStatus | None:
    """An NN worker's training status (step, samples, phase), blocking; None when it does not answer now."""
    with sync_channel(address) as channel:
        call = channel.unary_unary("/hybridrec.NNWorker/Status", request_serializer=pb.Empty.SerializeToString,
                                   response_deserializer=pb.TrainingStatus.FromString)
        try:
            return call(pb.Empty(), timeout=timeout_s)
        except grpc.RpcError:
            return None


def new_server(max_receive_bytes: int = MAX_MESSAGE_BYTES,
               max_concurrent_rpcs: int | None = None) -> grpc.aio.Server:
    """A grpc.aio server that refuses (RESOURCE_EXHAUSTED) a request larger than `max_receive_bytes` before
    reading it whole: a data-plane service passes what its job's largest request can be
    (`hybridrec.core.wire.frames.max_request_bytes`), the inference service its `max_request_bytes`; and, with
    `max_concurrent_rpcs`, any call past that many in progress (RESOURCE_EXHAUSTED, at once)."""
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    return grpc.aio.server(options=[*options, ("grpc.max_receive_message_length", int(max_receive_bytes))],
                           maximum_concurrent_rpcs=max_concurrent_rpcs)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind and return the port actually bound (port 0 picks a free one)."""
    if _security is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        credentials = grpc.ssl_server_credentials([(_security.key, _security.cert)], root_certificates=_security.ca,
                                                  require_client_auth=_security.require_client_auth)
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound


def add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """The standard grpc.health.v1 service. Its overall status must be set NOT_SERVING before the server
    starts (`set_serving(servicer, False)`): grpcio's servicer starts it SERVING, which would tell a readiness
    probe, and a peer waiting in `wait_until_serving`, that a service is ready before its dependencies answer."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


LIVENESS = "liveness"
"""The health service's name for "the process runs" (liveness probes); "" is the overall status, SERVING only
once the service's dependencies answer (readiness)."""


async def start_server(server: grpc.aio.Server, servicer: health.aio.HealthServicer, host: str, port: int) -> int:
    """Bind `server` (its health service `servicer`) and start it: NOT_SERVING until the service says it is
    ready (`set_serving`), its liveness SERVING. Returns the port bound (port 0 picks a free one)."""
    bound = bind(server, host, port)
    await set_serving(servicer, False)
    await server.start()
    await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return bound


async def set_serving(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await servicer.set("", status)


async def is_serving(address: str, *, timeout_s: float = 2.0, service: str = "") -> bool:
    async with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def is_serving_now(address: str, *, timeout_s: float = 1.0) -> bool:
    """`is_serving` for blocking callers (the launcher)."""
    with sync_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def wait_until_serving(addresses: list[str], *, timeout_s: float, what: str = "services") -> None:
    """Poll health with jittered backoff until every address is SERVING; TimeoutError names the laggards.

    The backoff stops growing at a quarter of a second: each service waits here for its peers at start-up, so a
    longer sleep would be added to the job's start-up for nothing (a health check on loopback costs a
    millisecond)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.02
    pending = list(addresses)
    while pending:
        results = await asyncio.gather(*(is_serving(a) for a in pending))
        pending = [a for a, ok in zip(pending, results) if not ok]
        if not pending:
            return
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not SERVING after {timeout_s:.0f} s: {', '.join(pending)}")
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.25)


async def retry(call: Callable[[], Awaitable[Any]], *, deadline_s: float, base_delay_s: float = 0.05,
                max_delay_s: float = 0.5,
                retry_on: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)) -> Any:
    """Run `call`, retrying on transient status codes with jittered exponential backoff until `deadline_s`.

    A peer being restarted in place (a PS re-attaching to its shm table, an
    embedding worker coming back) answers UNAVAILABLE for a few seconds; callers
    wait it out instead of failing the job. The delay stops growing at
    `max_delay_s` (0.5 s, 0.75 s with jitter): a restart takes about a second,
    and a caller should not sleep far past it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    delay = base_delay_s
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in retry_on or loop.time() + delay > deadline:
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, max_delay_s)


def install_stop_handlers(stop: asyncio.Event, also: Callable[[], None] | None = None) -> None:
    """SIGTERM / SIGINT set `stop` so the service shuts down gracefully (and call `also`)."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        if also is not None:
            also()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
