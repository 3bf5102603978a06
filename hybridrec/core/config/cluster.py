"""Where every replica of every service listens, TLS, timeouts and retries."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from hybridrec.core.config.section import Section


def _split_address(address: str, key: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{key}: {address!r} is not HOST:PORT")
    return host, int(port)


class TLSConfig(Section):
    """Mutual TLS on every gRPC channel: each process presents `cert` and trusts peers signed by `ca`."""

    ca: str
    """PEM file of the certificate authority that signed every service's certificate."""
    cert: str
    """PEM certificate of this process (servers and clients use the same one)."""
    key: str
    """PEM private key of `cert`."""
    server_name: str | None = None
    """Name to verify in server certificates instead of the dialled host (e.g. one cert for all services)."""


AUTO = "auto"
"""A replica list or thread count that `hybridrec run` sizes to the host (hybridrec/app/plan/layout.py)."""


SIZED_BY_HOST = ("dataloader", "embedding_workers", "ps", "nn_workers")
"""The replica lists that may be `auto`."""


class ClusterConfig(Section):
    """Where every replica listens. `hybridrec run` fills these in with free loopback ports. `ps`,
    `embedding_workers`, `dataloader` and `nn_workers` may each be `auto`: `hybridrec run` then runs as many
    as fit the host's cores and GPUs (hybridrec/app/plan/layout.py, printed at start); a service started alone
    (`hybridrec serve`) needs the addresses listed."""

    ps: list[str] = Field(default_factory=lambda: ["127.0.0.1:0", "127.0.0.1:0"])
    """HOST:PORT of every embedding PS shard (shard i is the i-th)."""
    embedding_workers: list[str] = Field(default_factory=lambda: ["127.0.0.1:0"])
    """HOST:PORT of every embedding worker (at most 255)."""
    nn_workers: list[str] = Field(default_factory=lambda: ["127.0.0.1:0", "127.0.0.1:0"])
    """HOST:PORT of every NN worker (rank i is the i-th)."""
    dataloader: list[str] = Field(default_factory=lambda: ["127.0.0.1:0"])
    """HOST:PORT of every data loader (loader l is the l-th). Each reads its own split of `data.train` and
    `data.eval` (services/dataloader/splits.py: plain TSV by byte ranges, gzip files whole, Parquet by row
    groups, prepared data by rows; with `data.stream`, partition l of the subject), and the NN workers take
    their batches from the loaders in turn. A layout the data cannot give every loader a share of (fewer gzip
    files, Parquet row groups or prepared rows than loaders) is refused at start; a checkpoint resumes only
    with the number of loaders that wrote it."""
    rendezvous: str = "127.0.0.1:0"
    """torch.distributed MASTER_ADDR:MASTER_PORT (rank 0's host)."""
    metrics_port: Annotated[int, Field(ge=0, lt=65536)] = 0
    """Prometheus HTTP port of each service (0: a free port under `hybridrec run`)."""
    bind_host: str = "0.0.0.0"
    """Address every gRPC server binds (the port comes from the service's own entry above)."""
    tls: TLSConfig | None = None
    """Mutual TLS on every channel (None: plaintext, for a trusted network)."""
    control_identities: list[str] | None = None
    """With TLS: certificate identities (subject common name or a subject alternative name) allowed to call
    control methods (PS Checkpoint, LoadCheckpoint, Publish), e.g. the NN workers' and the launcher's;
    everyone else gets PERMISSION_DENIED. Data-plane methods stay open to any certificate the CA signed.
    None: any peer (the only choice without TLS)."""
    ps_identities: list[str] | None = None
    """With TLS: the certificate identity (subject common name or a subject alternative name) of each PS, in
    `cluster.ps` order. The PS-peer methods (Replicate, PullShard: `ps.replicas: 2`) are then refused
    (PERMISSION_DENIED) to every other caller, and each to all but the one PS that may call it: a backup takes
    rows only from its shard's primary, a copy goes only to the shard's backup or, restoring, to the shard.
    None: any certificate the CA signed."""
    rpc_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """Deadline of one data-plane RPC."""
    retry_s: Annotated[float, Field(gt=0)] = 120.0
    """How long a caller keeps retrying a peer that answers UNAVAILABLE (e.g. a PS restarting in place)."""
    max_restarts: Annotated[int, Field(ge=0)] = 3
    """`hybridrec run`: how many deaths of one process are restarted when they look like a crash loop — it
    failed on its own (a PS or embedding worker is restarted even then) or died before it ever served — and
    how many such group restarts from a checkpoint. A process killed from outside (a signal, a lost peer)
    after it was serving is always restarted: that is a machine or an operator, not a loop."""
    start_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """How long a service waits for the peers it depends on to report SERVING."""
    dense_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """With NCCL: how long one dense collective (a training step's AllReduce) waits for a peer before it fails
    and the group re-forms around the peer's replacement; how long a step can hang on a lost GPU worker. (CPU
    collectives, and every collective under Gloo, wait 5 x start_timeout_s: a checkpoint's barrier waits for
    rank 0's PS dump.)"""
    rejoin_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long the NN workers wait for every rank to (re)join the group: at the start, and after one was lost
    and is being replaced (its restart included). A replacement with another config, world size or model is
    refused meanwhile; after this long the group stops, naming the missing ranks and the refusals."""

    @field_validator(*SIZED_BY_HOST, mode="before")
    @classmethod
    def _auto(cls, value):
        return [AUTO] if value == AUTO else value

    def sized_by_host(self) -> list[str]:
        """The replica lists given as `auto` (still to be sized: `hybridrec.app.plan.layout.fit`)."""
        return [key for key in SIZED_BY_HOST if getattr(self, key) == [AUTO]]

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        for key in ("ps", "embedding_workers", "nn_workers", "dataloader"):
            addresses = getattr(self, key)
            if not addresses:
                raise ValueError(f"cluster.{key} needs at least one address")
            if addresses == [AUTO]:
                continue
            for address in addresses:
                _split_address(address, f"cluster.{key}")
        if len(self.embedding_workers) > 255:
            raise ValueError("cluster.embedding_workers: at most 255 embedding workers")
        _split_address(self.rendezvous, "cluster.rendezvous")
        for key in ("control_identities", "ps_identities"):
            if getattr(self, key) is not None and self.tls is None:
                raise ValueError(f"cluster.{key}: authorising callers needs cluster.tls (mutual TLS identifies "
                                 f"them)")
        if self.ps_identities is not None and self.ps != [AUTO] and len(self.ps_identities) != len(self.ps):
            raise ValueError(f"cluster.ps_identities: {len(self.ps_identities)} identities for {len(self.ps)} PS "
                             f"processes (cluster.ps): one each, in the same order")
        return self


def split_address(address: str) -> tuple[str, int]:
    return _split_address(address, "address")
