"""The one configuration file of a hybridrec job, validated once at start (docs/architecture.md#configuration).

Every process (launcher and each service) loads the same YAML into these typed
models; a bad key is reported as `ConfigError` naming the dotted key and what
was expected, which the CLI turns into exit code 2. Any key can be overridden
with `--set a.b.c=value` (the value is parsed as YAML: `--set training.epochs=2`).

A package of typed sections, one module each: `section` (the base and `ConfigError`), `features` (features,
tables, pooling, the model), `optimizers`, `training`, `data`, `ps`, `cluster`, `outputs` (checkpoints, live
versions, the output directory), and `job` (`Config` itself, and loading a file with `--set` overrides). Every
name is re-exported here: code imports `from hybridrec.core.config import ...` and never needs to know which
section holds a key.
"""
from __future__ import annotations

from hybridrec.core.config.section import ConfigError, Section
from hybridrec.core.config.features import (Pooling, FeatureKind, TableConfig, FeatureConfig, criteo_features,
    ids_per_sample, resolve_tables, ModelConfig)
from hybridrec.core.config.optimizers import (EmbeddingOptimizer, EmbeddingOptimizerConfig, DenseOptimizerConfig,
    LrDecayConfig, OptimizerConfig)
from hybridrec.core.config.training import Mode, CompressionConfig, TrainingConfig
from hybridrec.core.config.data import StreamConfig, TaskConfig, DataConfig
from hybridrec.core.config.ps import (WeightStorage, InitConfig, TableLifecycleConfig, LifecycleConfig, TierConfig,
    PSConfig)
from hybridrec.core.config.cluster import TLSConfig, AUTO, SIZED_BY_HOST, ClusterConfig, split_address
from hybridrec.core.config.outputs import CheckpointConfig, PublishConfig, OutputConfig
from hybridrec.core.config.job import (Config, parse_overrides, apply_overrides, from_dict, describe_errors,
    load_config,
    dump_config)

__all__ = ["ConfigError", "Section", "Pooling", "FeatureKind", "TableConfig", "FeatureConfig", "criteo_features",
           "ids_per_sample",
           "resolve_tables", "ModelConfig", "EmbeddingOptimizer", "EmbeddingOptimizerConfig",
           "DenseOptimizerConfig", "LrDecayConfig", "OptimizerConfig", "Mode", "CompressionConfig", "TrainingConfig",
           "StreamConfig", "TaskConfig", "DataConfig", "WeightStorage", "InitConfig", "TableLifecycleConfig",
           "LifecycleConfig",
           "TierConfig", "PSConfig", "TLSConfig", "AUTO", "SIZED_BY_HOST", "ClusterConfig", "split_address",
           "CheckpointConfig", "PublishConfig", "OutputConfig", "Config", "parse_overrides",
           "apply_overrides", "from_dict", "describe_errors", "load_config", "dump_config"]
