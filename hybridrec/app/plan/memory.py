"""`hybridrec plan`'s figures: memory of the embedding PS before renting the machines (show.py prints them).

Part of the app (it runs in the CLI only); its numbers come from the PS store's own layout
(`store_files.planned_shm_bytes`): the values array (embedding + optimizer
state per row), the open-addressing index (a power of two >= 2x each stripe's
rows), the keys and the LRU prev/next arrays, the lifecycle's per-table
counters, and where the lifecycle uses them its admission sketch (fixed:
sketch_width x sketch_depth bytes per store) and per-row update stamps (16
bytes per row, with a TTL), per shard and in total. Besides those files a PS
holds private memory that grows with its tables: each store's per-slot
stamps and changed-row marks (`store.PRIVATE_BYTES_PER_SLOT`) and, while it
dumps a checkpoint, one chunk buffer and one stripe's LRU order
(`checkpoint.dump_memory_bytes`; dumps run one store at a time, so the
largest store's counts). `per_shard_memory_bytes` is all of it: what a PS
host needs. From the same figures: the largest capacity a host's memory
holds (`largest_capacity`), how many PS hosts of a given memory a table
needs (`hosts_for`), and what a checkpoint writes (`checkpoint_bytes`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from hybridrec.core.config import (Config, ConfigError, EmbeddingOptimizer, EmbeddingOptimizerConfig, LifecycleConfig,
                              PSConfig, WeightStorage)
from services.embedding_ps.checkpoint import dump_memory_bytes, row_bytes
from services.embedding_ps.kernels import MAX_STRIPE_ROWS
from services.embedding_ps.optimizers import state_width
from services.embedding_ps.row_storage import STORAGE_CODES, weight_words
from services.embedding_ps.store import PRIVATE_BYTES_PER_SLOT
from services.embedding_ps.store_files import StoreConfig, planned_shm_bytes
from services.embedding_ps.tier import planned_bytes as planned_disk_bytes
from services.embedding_ps.tier import planned_marks as planned_disk_marks

MAX_STRIPES = 1024
"""ps.num_stripes' limit: with MAX_STRIPE_ROWS rows a stripe, the most rows one store of a shard can hold."""

OPTIMIZERS = tuple(m.value for m in EmbeddingOptimizer)


@dataclass(frozen=True)
class Table:
    ids: int
    dim: int


def plan_tables(tables: list[Table], *, optimizer: str, shards: int, num_stripes: int | None = None,
                headroom: float = 1.0, admit_after: int = 1, ttl: bool = False, sketch_width: int = 1 << 22,
                sketch_depth: int = 4, storage: str = "fp32") -> dict:
    """Per-shard and total bytes for tables sharded evenly over `shards` (capacity = ids/shards x headroom).

    Tables of one width share a store on each shard, as in the PS (one store per width), so their IDs add
    up into one capacity and one sketch; tables of different widths get stores of their own (`stores`:
    per width, its rows and bytes per shard). `num_stripes` defaults to 16, or more when a stripe would
    exceed the store's row limit. admit_after > 1 adds each store's sketch (sketch_width x sketch_depth
    bytes), `ttl` the rows' stamps. `storage`: ps.storage (fp16 / bf16: two weights a word).
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
    configs = []
    for dim, ids in sorted(ids_by_dim.items()):
        table = Table(ids, dim)
        capacity = max(16, math.ceil(table.ids / shards * headroom))
        stripes = num_stripes or max(16, 1 << (math.ceil(capacity / MAX_STRIPE_ROWS) - 1).bit_length())
        if stripes > MAX_STRIPES:
            least = math.ceil(table.ids * headroom / (MAX_STRIPES * MAX_STRIPE_ROWS))
            raise TooManyStripes(f"a shard's store of width {dim} would hold {capacity:,} rows: more than "
                                 f"{MAX_STRIPES} stripes of at most {MAX_STRIPE_ROWS:,} rows; use at least "
                                 f"{least:,} shards", least)
        spec = EmbeddingOptimizerConfig(name=optimizer)
        lifecycle = LifecycleConfig(admit_after=admit_after, ttl_steps=1 if ttl else None,
                                    sketch_width=sketch_width, sketch_depth=sketch_depth)
        ps = PSConfig(capacity=capacity, num_stripes=stripes, lifecycle=lifecycle, storage=storage)
        configs.append(StoreConfig(dim=table.dim, optimizer=spec, ps=ps))
        raw += capacity * configs[-1].row_width * 4
    result = _plan_stores(configs, shards)
    return result | {"optimizer": optimizer, "storage": storage, "parameters": sum(t.ids * t.dim for t in tables),
                     "overhead_vs_values_and_state": result["per_shard_bytes"] / raw if raw else None}


def _plan_stores(configs: list[StoreConfig], shards: int) -> dict:
    """Every byte a PS shard holds for stores of `configs` (one per width): files, private arrays, a dump's
    buffers; per shard and in total."""
    per_shard: dict[str, int] = {}
    stores: list[dict] = []
    for config in configs:
        parts = planned_shm_bytes(config)
        for name, nbytes in parts.items():
            per_shard[name] = per_shard.get(name, 0) + nbytes
        stores.append({"dim": config.dim, "rows_per_shard": config.capacity, "per_shard_bytes": sum(parts.values()),
                       "stripes": config.num_stripes, "row_bytes_in_checkpoints": row_bytes(config),
                       "disk_rows_per_shard": config.ps.tier.capacity if config.ps.tier else 0,
                       "disk_bytes_per_shard": planned_disk_bytes(config)})
    private = {"stamps_and_marks": sum(PRIVATE_BYTES_PER_SLOT * c.capacity for c in configs),
               "checkpoint_buffers": max(dump_memory_bytes(c) for c in configs)}
    if any(c.ps.tier is not None for c in configs):  # one change mark per disk record
        private["disk_tier_marks"] = sum(planned_disk_marks(c) for c in configs)
    shard_bytes = sum(per_shard.values())
    memory = shard_bytes + sum(private.values())
    disk = sum(s["disk_bytes_per_shard"] for s in stores)
    return {"shards": shards, "rows_per_shard": sum(c.capacity for c in configs), "per_shard_bytes": shard_bytes,
            "per_shard_parts": per_shard, "per_shard_private": private, "per_shard_memory_bytes": memory,
            "stores": stores, "total_bytes": shard_bytes * shards, "total_memory_bytes": memory * shards,
            "per_shard_disk_bytes": disk, "total_disk_bytes": disk * shards,
            "disk_rows_per_shard": sum(s["disk_rows_per_shard"] for s in stores),
            "full_checkpoint_bytes_per_shard": sum(row_bytes(c) * table_capacity(c) for c in configs)}


def table_capacity(config: StoreConfig) -> int:
    """The rows a shard's store of `config` may hold in all: its disk tier's capacity, or its memory's."""
    return config.ps.tier.capacity if config.ps.tier is not None else config.capacity


def checkpoint_bytes(result: dict, *, changed: float, interval_s: float) -> dict:
    """What a checkpoint of a full table of `result` (a plan) writes per shard: a full dump, a delta with a
    `changed` share of the rows changed, and the write bandwidth a delta every `interval_s` seconds takes."""
    full = result["full_checkpoint_bytes_per_shard"]
    delta = int(full * changed)
    return {"full_per_shard": full, "delta_per_shard": delta, "changed_share": changed, "interval_s": interval_s,
            "delta_bandwidth_per_shard": delta / interval_s, "full_total": full * result["shards"]}


class TooManyStripes(ValueError):
    """A shard's store would need more than MAX_STRIPES stripes; `least` shards would do."""

    def __init__(self, message: str, least: int):
        super().__init__(message)
        self.least = least


def hosts_for(tables: list[Table], *, optimizer: str, host_bytes: int, **options) -> dict:
    """The plan that holds `tables` on the fewest hosts of `host_bytes` of memory: `hosts`, `shards_per_host`
    and the PS shards' plan. The fewest shards that fit a host, each its own host, may not be it: where a
    store's stripe limit, not the memory, sets the shard count, a host holds several; and a few more, smaller
    shards may pack a host fuller (three of 4 TiB rather than two of 4.5 on 12 TiB)."""
    shards, result = _fewest_shards(tables, optimizer, host_bytes, 1, **options)
    best = _packed(result, shards, host_bytes)
    for per_host in range(best["shards_per_host"] + 1, best["shards_per_host"] + 5):
        shards, result = _fewest_shards(tables, optimizer, host_bytes, per_host, first=shards, **options)
        packed = _packed(result, shards, host_bytes)
        if packed["hosts"] < best["hosts"]:
            best = packed
    return best


def _packed(result: dict, shards: int, host_bytes: int) -> dict:
    per_host = host_bytes // result["per_shard_memory_bytes"]
    return result | {"host_bytes": host_bytes, "shards_per_host": per_host, "hosts": math.ceil(shards / per_host)}


def _fewest_shards(tables: list[Table], optimizer: str, host_bytes: int, per_host: int, *, first: int = 1,
                   **options) -> tuple[int, dict]:
    """The fewest shards (from `first` on) of which `per_host` fit in `host_bytes`, and their plan."""
    spec = EmbeddingOptimizerConfig(name=optimizer)
    storage = STORAGE_CODES[WeightStorage(options.get("storage", "fp32"))]
    values = sum(t.ids * (weight_words(t.dim, storage) + state_width(spec, t.dim)) * 4 for t in tables)
    budget = host_bytes // per_host
    shards = max(first, math.ceil(values / budget))  # values and state alone: a lower bound
    while True:
        try:
            result = plan_tables(tables, optimizer=optimizer, shards=shards, **options)
        except TooManyStripes as exc:
            shards = exc.least
            continue
        if result["per_shard_memory_bytes"] <= budget:
            return shards, result
        if result["rows_per_shard"] <= 16 * len(result["stores"]):
            raise ValueError(f"a host of {human(host_bytes)} cannot hold even a PS shard's fixed memory "
                             f"({human(result['per_shard_memory_bytes'])})")
        shards = max(shards + 1, math.ceil(shards * result["per_shard_memory_bytes"] / budget))


def largest_capacity(config: Config, shards_on_host: int, memory_bytes: int, files_bytes: int) -> int:
    """The largest ps.capacity with which `shards_on_host` shards of `config` fit in `memory_bytes` of memory,
    their store files in `files_bytes` (0: none fits)."""
    def fits(capacity: int) -> bool:
        stripes = max(config.ps.num_stripes, math.ceil(capacity / MAX_STRIPE_ROWS))
        if stripes > MAX_STRIPES:
            return False
        ps = config.ps.model_copy(update={"capacity": capacity, "num_stripes": stripes})
        result = _plan_stores([StoreConfig.from_config(config.model_copy(update={"ps": ps}), dim)
                               for dim in config.dims], shards_on_host)
        return result["total_memory_bytes"] <= memory_bytes and result["total_bytes"] <= files_bytes

    lo, hi = 0, max(16, config.ps.num_stripes)
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 1000):  # to 0.1 %: the index grows in powers of two anyway
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_config(config: Config) -> dict:
    """What the configured PS allocates: one store per width with ps.capacity rows, on every shard."""
    configs = [StoreConfig.from_config(config, dim) for dim in config.dims]
    return _plan_stores(configs, len(config.cluster.ps)) | {"optimizer": config.optimizer.embedding.name.value,
                                                             "storage": str(config.ps.storage)}


def host_memory_bytes() -> int:
    """This host's memory (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def free_bytes(path: str | Path) -> int:
    """Bytes free to an unprivileged writer on the filesystem that holds `path` (or would: its nearest
    existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def check_fits(config: Config, *, host: str, memory_bytes: int, shm_free_bytes: int) -> None:
    """ConfigError naming the host, the widths and the bytes unless every PS shard of `config` on this host (a
    local run: all of them) fits its memory, their store files the free space under ps.shm_dir, and their disk
    tiers (ps.tier) the free space under ps.tier.dir."""
    try:
        result = plan_config(config)
    except ValueError as exc:  # a stripe over its row limit (store_files.StoreConfig)
        raise ConfigError(f"ps.capacity, ps.num_stripes: {exc}") from None
    if config.ps.tier is not None:
        free = free_bytes(config.ps.tier.dir)
        if result["total_disk_bytes"] > free:
            raise ConfigError(f"ps.tier.capacity: {result['shards']} PS shard(s) of {config.ps.tier.capacity:,} rows "
                              f"per width on disk need {result['total_disk_bytes']:,} bytes under {config.ps.tier.dir}"
                              f" ({human(result['total_disk_bytes'])}); it has {free:,} bytes free")
    shards = result["shards"]
    widths = ", ".join(f"width {s['dim']}: {human(s['per_shard_bytes'])} of files" for s in result["stores"])
    need, files = result["total_memory_bytes"], result["total_bytes"]
    if need <= memory_bytes and files <= shm_free_bytes:
        return
    largest = largest_capacity(config, shards, memory_bytes, shm_free_bytes)
    where = (f"{human(memory_bytes)} of memory" if need > memory_bytes
             else f"{human(shm_free_bytes)} free under {config.ps.shm_dir}")
    raise ConfigError(f"ps.capacity: {shards} PS shard(s) of {config.ps.capacity:,} rows per width on host {host} "
                      f"need {human(need)} ({human(result['per_shard_memory_bytes'])} a shard: {widths}, "
                      f"{human(sum(result['per_shard_private'].values()))} private), {human(files)} of it in store "
                      f"files; this host has {where}. At most {largest:,} rows per width fit (`hybridrec plan "
                      f"--config`), or put the PS on more hosts")


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
