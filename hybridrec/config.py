"""The one configuration file of a hybridrec job, validated once at start (docs/architecture.md#configuration).

Every process (launcher and each service) loads the same YAML into these typed
models; a bad key is reported as `ConfigError` naming the dotted key and what
was expected, which the CLI turns into exit code 2. Any key can be overridden
with `--set a.b.c=value` (the value is parsed as YAML: `--set training.epochs=2`).
"""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hybridrec.ids import MAX_GROUPS


def _split_address(address: str, key: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{key}: {address!r} is not HOST:PORT")
    return host, int(port)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Pooling(str, enum.Enum):
    SUM = "sum"  # sum of the bag's rows
    MEAN = "mean"  # sum divided by the bag length
    SQRTN = "sqrtn"  # sum divided by sqrt(bag length)


class FeatureConfig(_Model):
    """One ID-type feature: a column of the data and the embedding table it reads."""

    name: str
    """Column name (C1..C26 for Criteo)."""
    group: Annotated[int, Field(ge=0, lt=MAX_GROUPS)]
    """Feature group: the top bits of the feature's IDs; features of one group share rows."""
    dim: Annotated[int, Field(gt=0, le=4096)] = 16
    """Embedding width."""
    pooling: Pooling = Pooling.SUM
    """How a multi-valued bag becomes one vector."""


def criteo_features(dim: int = 16) -> list[FeatureConfig]:
    """The 26 Criteo categorical columns, one group each."""
    return [FeatureConfig(name=f"C{i + 1}", group=i, dim=dim) for i in range(26)]


class ModelConfig(_Model):
    path: str = "hybridrec.models:DNN"
    """Import path `package.module:Class` of an nn.Module taking (dense, embeddings)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the module besides the feature description."""


class EmbeddingOptimizerConfig(_Model):
    name: Literal["sgd", "adagrad", "adam", "ftrl"] = "adagrad"
    lr: Annotated[float, Field(gt=0)] = 0.05
    eps: Annotated[float, Field(ge=0)] = 1e-10
    initial_accumulator_value: Annotated[float, Field(ge=0)] = 0.0
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    adam_eps: Annotated[float, Field(gt=0)] = 1e-8
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class DenseOptimizerConfig(_Model):
    name: Literal["sgd", "adam", "adagrad"] = "adam"
    lr: Annotated[float, Field(gt=0)] = 1e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class OptimizerConfig(_Model):
    embedding: EmbeddingOptimizerConfig = Field(default_factory=EmbeddingOptimizerConfig)
    dense: DenseOptimizerConfig = Field(default_factory=DenseOptimizerConfig)


class Mode(str, enum.Enum):
    HYBRID = "hybrid"  # async embeddings with bounded staleness, synchronous dense AllReduce
    SYNC = "sync"  # staleness 0: every lookup waits for all earlier updates; the accuracy reference
    ASYNC = "async"  # dense replicas averaged periodically, embeddings async; the throughput reference
    SHADOW = "shadow"  # dense replicas synchronised by a background thread (ShadowSync)


class CompressionConfig(_Model):
    fp16: bool = True
    """Send embeddings and gradients as fp16 after scaling each vector by kappa/||v|| (hybridrec/compress.py)."""
    kappa: Annotated[float, Field(gt=0, le=60000)] = 1024.0
    """Norm each vector is scaled to before the fp16 cast."""
    lz4_ids: bool = True
    """lz4-compress ID position buffers."""


class TrainingConfig(_Model):
    mode: Mode = Mode.HYBRID
    batch_size: Annotated[int, Field(gt=0, le=65535)] = 4096
    """Samples per NN-worker step (≤ 65535 so positions fit uint16)."""
    epochs: Annotated[int, Field(gt=0)] = 1
    max_steps: Annotated[int, Field(gt=0)] | None = None
    """Stop after this many steps per NN worker (None: run the epochs)."""
    staleness: Annotated[int, Field(ge=0, le=1024)] = 4
    """Most batches an NN worker may have read embeddings for without their updates applied."""
    prefetch: Annotated[int, Field(ge=1, le=1024)] = 4
    """Batches whose embedding lookups are kept in flight ahead of compute."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto is NCCL when CUDA is present, else Gloo."""
    torch_threads: Annotated[int, Field(ge=1)] = 1
    """Intra-op threads per NN worker."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Dense forward/backward in fp32, or under bf16 autocast (GPUs, and CPUs with AVX512-BF16 or AMX:
    about 2x faster matmuls). Parameters, optimizer state, embeddings and the loss stay fp32."""
    sync_interval: Annotated[int, Field(ge=1)] = 16
    """async mode: average dense replicas every this many steps."""
    shadow_algorithm: Literal["easgd", "ma", "bmuf"] = "ma"
    shadow_alpha: Annotated[float, Field(gt=0, le=1)] = 0.5
    """ShadowSync elastic parameter."""
    shadow_interval_s: Annotated[float, Field(gt=0)] = 0.2
    eval_batch_size: Annotated[int, Field(gt=0, le=65535)] = 8192
    seed: int = 0
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    log_every_s: Annotated[float, Field(gt=0)] = 5.0


class DataConfig(_Model):
    source: Literal["criteo"] = "criteo"
    train: list[str] = Field(min_length=1)
    """Training files (Criteo TSV, optionally .gz)."""
    eval: list[str] = Field(default_factory=list)
    """Held-out files evaluated after training."""
    oracle: str | None = None
    """oracle.json written by `hybridrec data synth`; its oracle_auc goes into the summary."""
    bad_lines: Literal["skip", "error"] = "skip"
    """Malformed lines: skip and count them, or stop with file:line."""
    chunk_rows: Annotated[int, Field(gt=0)] = 65536


class InitConfig(_Model):
    distribution: Literal["uniform", "normal"] = "uniform"
    scale: Annotated[float, Field(ge=0)] = 0.01


class PSConfig(_Model):
    capacity: Annotated[int, Field(gt=0)] = 2_000_000
    """Rows per shard per embedding width; the least recently used row is evicted beyond it."""
    shm_dir: str = "/dev/shm/hybridrec"
    """Directory of the store's mmap'd files; a restarted PS re-attaches to it."""
    num_stripes: Annotated[int, Field(ge=1, le=1024)] = 16
    admit_probability: Annotated[float, Field(gt=0, le=1)] = 1.0
    weight_bound: Annotated[float, Field(gt=0)] | None = None
    init: InitConfig = Field(default_factory=InitConfig)
    threads: Annotated[int, Field(ge=1, le=64)] = 2
    """Request threads running the store's kernels."""
    keep_shm: bool = False
    """Keep the store files after `hybridrec run` ends (they are removed by default)."""


class TLSConfig(_Model):
    """Mutual TLS on every gRPC channel: each process presents `cert` and trusts peers signed by `ca`."""

    ca: str
    """PEM file of the certificate authority that signed every service's certificate."""
    cert: str
    """PEM certificate of this process (servers and clients use the same one)."""
    key: str
    """PEM private key of `cert`."""
    server_name: str | None = None
    """Name to verify in server certificates instead of the dialled host (e.g. one cert for all services)."""


class ClusterConfig(_Model):
    """Where every replica listens. `hybridrec run` fills these in with free loopback ports."""

    ps: list[str] = Field(default_factory=lambda: ["127.0.0.1:0", "127.0.0.1:0"])
    embedding_workers: list[str] = Field(default_factory=lambda: ["127.0.0.1:0"])
    nn_workers: list[str] = Field(default_factory=lambda: ["127.0.0.1:0", "127.0.0.1:0"])
    dataloader: list[str] = Field(default_factory=lambda: ["127.0.0.1:0"])
    rendezvous: str = "127.0.0.1:0"
    """torch.distributed MASTER_ADDR:MASTER_PORT (rank 0's host)."""
    metrics_port: Annotated[int, Field(ge=0, lt=65536)] = 0
    """Prometheus HTTP port of each service (0: a free port under `hybridrec run`)."""
    bind_host: str = "0.0.0.0"
    tls: TLSConfig | None = None
    """Mutual TLS on every channel (None: plaintext, for a trusted network)."""
    rpc_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """Deadline of one data-plane RPC."""
    retry_s: Annotated[float, Field(gt=0)] = 120.0
    """How long a caller keeps retrying a peer that answers UNAVAILABLE (e.g. a PS restarting in place)."""
    max_restarts: Annotated[int, Field(ge=0)] = 3
    """`hybridrec run`: how often a crashed PS or embedding worker is restarted in place."""
    start_timeout_s: Annotated[float, Field(gt=0)] = 120.0

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        for key in ("ps", "embedding_workers", "nn_workers", "dataloader"):
            addresses = getattr(self, key)
            if not addresses:
                raise ValueError(f"cluster.{key} needs at least one address")
            for address in addresses:
                _split_address(address, f"cluster.{key}")
        if len(self.dataloader) != 1:
            raise ValueError("cluster.dataloader: exactly one data loader is supported")
        if len(self.embedding_workers) > 255:
            raise ValueError("cluster.embedding_workers: at most 255 embedding workers")
        _split_address(self.rendezvous, "cluster.rendezvous")
        return self


class CheckpointConfig(_Model):
    dir: str | None = None
    """Where synchronised job checkpoints go (`hybridrec run`: <run dir>/checkpoints unless set). None: none at all."""
    interval_steps: Annotated[int, Field(gt=0)] | None = None
    """Checkpoint every this many steps per NN worker (None: no checkpoints)."""
    keep: Annotated[int, Field(ge=1)] = 2
    """Newest checkpoints kept."""
    resume: bool = True
    """Start from the newest complete checkpoint in `dir` when there is one (interval checkpoints on only)."""
    final: bool = True
    """Write a final checkpoint when training ends (every update applied, before evaluation), whenever `dir`
    is set, with or without an interval: what `hybridrec export` turns into a model bundle."""


class OutputConfig(_Model):
    dir: str = "runs/latest"
    """Where NN worker rank 0 writes summary.json and predictions."""


class Config(_Model):
    features: list[FeatureConfig] = Field(default_factory=criteo_features)
    num_dense: Annotated[int, Field(ge=0)] = 13
    model: ModelConfig = Field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    data: DataConfig
    ps: PSConfig = Field(default_factory=PSConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="after")
    def _check_features(self) -> "Config":
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError("features: feature names must be unique")
        dims: dict[int, int] = {}
        for f in self.features:
            if dims.setdefault(f.group, f.dim) != f.dim:
                raise ValueError(f"features: group {f.group} is used with widths {dims[f.group]} and {f.dim}")
        return self

    @property
    def dims(self) -> list[int]:
        """The distinct embedding widths: the PS keeps one store per width."""
        return sorted({f.dim for f in self.features})


def split_address(address: str) -> tuple[str, int]:
    return _split_address(address, "address")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[:i + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. training.epochs=2")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {exc}") from exc
        parsed.append((key.strip(), value))
    return parsed


def from_dict(tree: dict[str, Any], *, source: str = "config") -> Config:
    """Validate a config tree; errors name every bad key."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        got = err.get("input")
        got_s = "" if err["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {key}: {msg}{got_s}")
    return "\n".join(lines)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load, override and validate a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    return from_dict(tree, source=str(path))


def dump_config(config: Config, path: str | Path) -> None:
    """Write a config back as YAML (the launcher hands each service the resolved file)."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
