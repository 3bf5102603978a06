from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frame(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FloatList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ServiceStats(_message.Message):
    __slots__ = ("service", "replica", "values", "recovery")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    service: str
    replica: int
    values: _containers.ScalarMap[str, float]
    recovery: RecoveryStats
    def __init__(self, service: _Optional[str] = ..., replica: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., recovery: _Optional[_Union[RecoveryStats, _Mapping]] = ...) -> None: ...

class TableLifecycle(_message.Message):
    __slots__ = ("group", "admitted", "rejected", "expired", "dropped_gradients")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    group: int
    admitted: int
    rejected: int
    expired: int
    dropped_gradients: int
    def __init__(self, group: _Optional[int] = ..., admitted: _Optional[int] = ..., rejected: _Optional[int] = ..., expired: _Optional[int] = ..., dropped_gradients: _Optional[int] = ...) -> None: ...

class RecoveryStats(_message.Message):
    __slots__ = ("batches_recovered", "unapplied_train_batches", "updates_deduplicated", "rows_by_width", "tables", "life", "losses", "acks", "tier")
    class RowsByWidthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    BATCHES_RECOVERED_FIELD_NUMBER: _ClassVar[int]
    UNAPPLIED_TRAIN_BATCHES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    ROWS_BY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    LIFE_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    batches_recovered: int
    unapplied_train_batches: int
    updates_deduplicated: int
    rows_by_width: _containers.ScalarMap[int, int]
    tables: _containers.RepeatedCompositeFieldContainer[TableLifecycle]
    life: int
    losses: _containers.RepeatedCompositeFieldContainer[ShardLoss]
    acks: _containers.RepeatedCompositeFieldContainer[ShardAcks]
    tier: TierStats
    def __init__(self, batches_recovered: _Optional[int] = ..., unapplied_train_batches: _Optional[int] = ..., updates_deduplicated: _Optional[int] = ..., rows_by_width: _Optional[_Mapping[int, int]] = ..., tables: _Optional[_Iterable[_Union[TableLifecycle, _Mapping]]] = ..., life: _Optional[int] = ..., losses: _Optional[_Iterable[_Union[ShardLoss, _Mapping]]] = ..., acks: _Optional[_Iterable[_Union[ShardAcks, _Mapping]]] = ..., tier: _Optional[_Union[TierStats, _Mapping]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("memory_rows", "memory_bytes", "disk_rows", "disk_bytes", "lookups", "misses", "fills", "writebacks", "overflows", "disk_updates")
    MEMORY_ROWS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    FILLS_FIELD_NUMBER: _ClassVar[int]
    WRITEBACKS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOWS_FIELD_NUMBER: _ClassVar[int]
    DISK_UPDATES_FIELD_NUMBER: _ClassVar[int]
    memory_rows: int
    memory_bytes: int
    disk_rows: int
    disk_bytes: int
    lookups: int
    misses: int
    fills: int
    writebacks: int
    overflows: int
    disk_updates: int
    def __init__(self, memory_rows: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., disk_rows: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., misses: _Optional[int] = ..., fills: _Optional[int] = ..., writebacks: _Optional[int] = ..., overflows: _Optional[int] = ..., disk_updates: _Optional[int] = ...) -> None: ...

class ShardLoss(_message.Message):
    __slots__ = ("shard", "life", "applied_at_checkpoint", "restored_step", "from_replica")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LIFE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AT_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICA_FIELD_NUMBER: _ClassVar[int]
    shard: int
    life: int
    applied_at_checkpoint: int
    restored_step: int
    from_replica: bool
    def __init__(self, shard: _Optional[int] = ..., life: _Optional[int] = ..., applied_at_checkpoint: _Optional[int] = ..., restored_step: _Optional[int] = ..., from_replica: _Optional[bool] = ...) -> None: ...

class ShardAcks(_message.Message):
    __slots__ = ("shard", "life", "updates")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LIFE_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    shard: int
    life: int
    updates: int
    def __init__(self, shard: _Optional[int] = ..., life: _Optional[int] = ..., updates: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("name", "step", "base")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    name: str
    step: int
    base: int
    def __init__(self, name: _Optional[str] = ..., step: _Optional[int] = ..., base: _Optional[int] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("name", "rows", "chain", "bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    chain: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., chain: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("version", "full", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    full: bool
    base_version: int
    def __init__(self, version: _Optional[int] = ..., full: _Optional[bool] = ..., base_version: _Optional[int] = ...) -> None: ...

class PublishedFile(_message.Message):
    __slots__ = ("path", "bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("rows", "files", "rows_by_dim")
    class RowsByDimEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    ROWS_BY_DIM_FIELD_NUMBER: _ClassVar[int]
    rows: int
    files: _containers.RepeatedCompositeFieldContainer[PublishedFile]
    rows_by_dim: _containers.ScalarMap[int, int]
    def __init__(self, rows: _Optional[int] = ..., files: _Optional[_Iterable[_Union[PublishedFile, _Mapping]]] = ..., rows_by_dim: _Optional[_Mapping[int, int]] = ...) -> None: ...

class TrainingStatus(_message.Message):
    __slots__ = ("done", "step", "samples", "loss", "samples_per_sec", "phase", "train_auc", "train_s")
    DONE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_AUC_FIELD_NUMBER: _ClassVar[int]
    TRAIN_S_FIELD_NUMBER: _ClassVar[int]
    done: bool
    step: int
    samples: int
    loss: float
    samples_per_sec: float
    phase: str
    train_auc: float
    train_s: float
    def __init__(self, done: _Optional[bool] = ..., step: _Optional[int] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_sec: _Optional[float] = ..., phase: _Optional[str] = ..., train_auc: _Optional[float] = ..., train_s: _Optional[float] = ...) -> None: ...
