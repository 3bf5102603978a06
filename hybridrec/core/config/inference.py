"""Settings of the inference service (`hybridrec serve inference`), validated like the job config.

The inference service does not read a training job's config: what it serves
is described by the bundle (features, model, precision), and how it serves by
these settings. They come from an optional YAML file (`--config`), then the
command's options (`--bundle`, `--ps`), then `--set key=value` overrides, in
that order; an error names the dotted key (exit code 2 from the CLI).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, model_validator

from hybridrec.core.config import ConfigError, Section, TLSConfig, apply_overrides, describe_errors, split_address


class BatchingConfig(Section):
    """Dynamic batching: concurrent requests merged into one lookup and one forward pass."""

    enabled: bool = True
    """Merge concurrent requests (off: every request is its own micro-batch)."""
    max_batch_rows: Annotated[int, Field(ge=1, le=65535)] = 1024
    """Rows of one micro-batch: requests are merged until the next one would exceed this
    (a single request larger than this is still answered, alone)."""
    inline_max_rows: Annotated[int, Field(ge=0, le=65535)] = 64
    """Micro-batches of at most this many rows run their forward pass on the event loop's thread: for
    them, handing over to the compute thread costs more than the forward pass. Larger ones run on the
    compute thread while the loop keeps receiving requests."""
    max_delay_ms: Annotated[float, Field(ge=0, le=1000)] = 1.0
    """How long a micro-batch waits for more requests, once requests are arriving concurrently
    (a request arriving alone on an idle server never waits). 0: take only what is queued."""


class ServingTLSConfig(TLSConfig):
    """TLS on both inference endpoints (gRPC and REST, HTTPS) and on its calls to read-only PS shards: the
    server presents `cert`; clients present a certificate signed by `ca` only if `require_client_cert`. The
    PS shards are called with the same `cert` (they require one: their --tls is mutual)."""

    require_client_cert: bool = False
    """Refuse a client that presents no certificate signed by `ca` (mutual TLS on both endpoints); false: any
    client that trusts the server's certificate is answered, a client certificate is not asked for."""


class InferenceConfig(Section):
    """How `hybridrec serve inference` serves one model bundle over the Open Inference Protocol."""

    bundle: str | None = None
    """Model bundle directory (written by `hybridrec export`). Exactly one of `bundle` and `follow`."""
    follow: str | None = None
    """A training job's versions directory (publish.dir): serve its newest version and swap in each new one
    (docs/serving.md#live-versions). Exactly one of `bundle` and `follow`."""
    follow_poll_s: Annotated[float, Field(gt=0)] = 0.5
    """With `follow`: how often the versions directory is looked at."""
    follow_wait_s: Annotated[float, Field(gt=0)] = 600.0
    """With `follow`: how long start-up waits for a first complete version before failing."""
    model_name: str = "hybridrec"
    """Name the model is served under: /v2/models/<model_name>, ModelInferRequest.model_name."""
    host: str = "127.0.0.1"
    """Address both endpoints bind (loopback by default; 0.0.0.0 for every interface)."""
    grpc_port: Annotated[int, Field(ge=0, lt=65536)] = 8001
    """gRPC port (GRPCInferenceService and grpc.health.v1); 0 picks a free one."""
    http_port: Annotated[int, Field(ge=0, lt=65536)] | None = 8000
    """REST port (/v2/...; also /metrics); 0 picks a free one, null turns REST off."""
    metrics_port: Annotated[int, Field(ge=0, lt=65536)] = 0
    """A separate Prometheus endpoint, as the training services have (0: none; /metrics on the REST port
    is always there)."""
    ps: list[str] = Field(default_factory=list)
    """Read-only PS shards (HOST:PORT, shard order) to look embeddings up in, instead of the bundle's
    own tables in this process. Their count must be the bundle's shard count."""
    ps_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Deadline of one PS lookup."""
    ps_start_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long start-up waits for every `ps` shard to report SERVING (they verify their bundle first)."""
    ps_kappa: Annotated[float, Field(gt=0)] = 1024.0
    """training.compression.kappa of the PS shards, for rows they send as scaled fp16 (float32 rows
    need nothing)."""
    max_request_rows: Annotated[int, Field(ge=1, le=65535)] = 4096
    """Rows one request may carry; a larger one is refused (INVALID_ARGUMENT / 400)."""
    max_request_bytes: Annotated[int, Field(gt=0, le=1 << 30)] | None = None
    """The largest request either endpoint reads: past it gRPC answers RESOURCE_EXHAUSTED and REST 413 before
    the request is read, so no size of request can make the server allocate much. None: `max_request_rows`
    times `REQUEST_ROW_BYTES` (4 KiB: a Criteo row as text is about 300 bytes; raise it for long list
    features given as strings)."""
    max_concurrent_requests: Annotated[int, Field(ge=1)] = 256
    """Requests in the server at once (being decoded, or waiting for their micro-batch): past it gRPC answers
    RESOURCE_EXHAUSTED and REST 429 with a Retry-After header, at once."""
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    """Dynamic batching (see BatchingConfig)."""
    tls: ServingTLSConfig | None = None
    """TLS on the gRPC and REST endpoints and the read-only PS calls (`--tls CA --tls CERT --tls KEY`); None:
    plaintext, for a loopback or a mesh that encrypts (see ServingTLSConfig)."""
    http_read_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """A REST request's body must arrive within this many seconds of its headers, else 408: a client that
    trickles a body cannot hold a request slot (one of `max_concurrent_requests`) for long."""
    http_idle_timeout_s: Annotated[float, Field(gt=0)] = 75.0
    """A REST connection with no request in progress is closed after this many seconds."""
    torch_threads: Annotated[int, Field(ge=0)] = 0
    """torch intra-op threads for the forward pass (0: torch's default)."""
    verify_bundle: bool = True
    """Check every bundle file's size and sha256 before serving it."""
    compile_dense: bool = True
    """Run the dense forward pass in ONNX Runtime (exported when a version is loaded, and checked against
    the model: one that cannot be exported, or answers differently, runs in PyTorch with a warning).
    false: always PyTorch, eagerly."""
    triton_instances: Annotated[int, Field(ge=0, le=256)] = 0
    """With `--engine triton`: Python-backend instances (processes) answering the model; 0: one per core, at
    most 8 (measured on 2 cores: 16 requests in flight answered 5.6x the sequential rate with 2 instances,
    3.8-4.1x with 1)."""

    @model_validator(mode="after")
    def _check(self) -> "InferenceConfig":
        for address in self.ps:
            split_address(address)
        if (self.bundle is None) == (self.follow is None):
            raise ValueError("bundle / follow: give exactly one (--bundle DIR or --follow DIR)")
        if self.follow is not None and self.ps:
            raise ValueError("ps: read-only PS shards serve one bundle; --follow serves each version's merged "
                             "table in this process")
        return self


def load_inference_config(path: str | Path | None, *, values: dict[str, Any] | None = None,
                          overrides: list[str] | None = None) -> InferenceConfig:
    """Settings from YAML file `path` (optional), then `values` (the CLI's options), then `--set` overrides."""
    tree: dict[str, Any] = {}
    source = "inference settings"
    if path is not None:
        source = str(path)
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of settings at the top level")
    for key, value in (values or {}).items():
        if value is not None:
            tree[key] = value
    apply_overrides(tree, overrides)
    try:
        return InferenceConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, source)) from None


REQUEST_ROW_BYTES = 4 << 10
"""A request row's bytes in the default `max_request_bytes`."""


def request_bytes(settings: InferenceConfig) -> int:
    """The largest request the inference service reads (`max_request_bytes`, or its default)."""
    return settings.max_request_bytes or min(settings.max_request_rows * REQUEST_ROW_BYTES, 1 << 30)
