"""`hybridrec plan`: memory of the embedding PS before renting the machines.

Part of the app (it runs in the CLI only); its numbers come from the PS store's own layout
(`store_files.planned_shm_bytes`): the values array (embedding + optimizer
state per row), the open-addressing index (a power of two >= 2x each stripe's
rows), the keys and the LRU prev/next arrays, the lifecycle's per-table
counters, and where the lifecycle uses them its admission sketch (fixed:
sketch_width x sketch_depth bytes per store) and per-row update stamps (16
bytes per row, with a TTL), per shard and in total.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hybridrec.config import Config, EmbeddingOptimizer, EmbeddingOptimizerConfig, LifecycleConfig, PSConfig
from services.embedding_ps.kernels import MAX_STRIPE_ROWS
from services.embedding_ps.optimizers import state_width
from services.embedding_ps.store_files import StoreConfig, planned_shm_bytes

OPTIMIZERS = tuple(m.value for m in EmbeddingOptimizer)


@dataclass(frozen=True)
class Table:
    ids: int
    dim: int


def plan_tables(tables: list[Table], *, optimizer: str, shards: int, num_stripes: int | None = None,
                headroom: float = 1.0, admit_after: int = 1, ttl: bool = False, sketch_width: int = 1 << 22,
                sketch_depth: int = 4) -> dict:
    """Per-shard and total bytes for tables sharded evenly over `shards` (capacity = ids/shards x headroom).

    Tables of one width share a store on each shard, as in the PS (one store per width), so their IDs add
    up into one capacity and one sketch; tables of different widths get stores of their own (`stores`:
    per width, its rows and bytes per shard). `num_stripes` defaults to 16, or more when a stripe would
    exceed the store's row limit. admit_after > 1 adds each store's sketch (sketch_width x sketch_depth
    bytes), `ttl` the rows' stamps.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if shards < 1:
        raise ValueError(f"shards must be positive, got {shards}")
    per_shard: dict[str, int] = {}
    stores: list[dict] = []
    rows = 0
    raw = 0
    ids_by_dim: dict[int, int] = {}
    for table in tables:
        if table.ids < 1 or table.dim < 1:
            raise ValueError(f"a table needs ids >= 1 and dim >= 1, got {table.ids} ids of width {table.dim}")
        ids_by_dim[table.dim] = ids_by_dim.get(table.dim, 0) + table.ids
    for dim, ids in sorted(ids_by_dim.items()):
        table = Table(ids, dim)
        capacity = max(16, math.ceil(table.ids / shards * headroom))
        stripes = num_stripes or max(16, 1 << (math.ceil(capacity / MAX_STRIPE_ROWS) - 1).bit_length())
        spec = EmbeddingOptimizerConfig(name=optimizer)
        lifecycle = LifecycleConfig(admit_after=admit_after, ttl_steps=1 if ttl else None,
                                    sketch_width=sketch_width, sketch_depth=sketch_depth)
        ps = PSConfig(capacity=capacity, num_stripes=stripes, lifecycle=lifecycle)
        parts = planned_shm_bytes(StoreConfig(dim=table.dim, optimizer=spec, ps=ps))
        for name, nbytes in parts.items():
            per_shard[name] = per_shard.get(name, 0) + nbytes
        stores.append({"dim": dim, "rows_per_shard": capacity, "per_shard_bytes": sum(parts.values())})
        rows += capacity
        raw += capacity * (table.dim + state_width(spec, table.dim)) * 4
    shard_bytes = sum(per_shard.values())
    return {"shards": shards, "optimizer": optimizer, "rows_per_shard": rows, "per_shard_bytes": shard_bytes,
            "per_shard_parts": per_shard, "stores": stores, "total_bytes": shard_bytes * shards,
            "parameters": sum(t.ids * t.dim for t in tables),
            "overhead_vs_values_and_state": shard_bytes / raw if raw else None}


def plan_config(config: Config) -> dict:
    """What the configured PS allocates: one store per width with ps.capacity rows, on every shard."""
    per_shard: dict[str, int] = {}
    stores: list[dict] = []
    for dim in config.dims:
        parts = planned_shm_bytes(StoreConfig.from_config(config, dim))
        for name, nbytes in parts.items():
            per_shard[name] = per_shard.get(name, 0) + nbytes
        stores.append({"dim": dim, "rows_per_shard": config.ps.capacity, "per_shard_bytes": sum(parts.values())})
    shards = len(config.cluster.ps)
    shard_bytes = sum(per_shard.values())
    return {"shards": shards, "optimizer": config.optimizer.embedding.name.value,
            "rows_per_shard": config.ps.capacity * len(config.dims), "per_shard_bytes": shard_bytes,
            "per_shard_parts": per_shard, "stores": stores, "total_bytes": shard_bytes * shards}


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
