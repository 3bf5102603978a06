"""Which PS shard owns an ID: `splitmix64(id) mod num_shards` (docs/architecture.md#ids-and-sharding).

Hashing before the modulo spreads a hot feature group (whose IDs share their
top bits) evenly over the shards. The embedding worker routes lookups with it
and the PS re-shards checkpoints with it, so both import this one function.
The store's own index must use a *different* mix, or each shard would fill
only 1/num_shards of its hash slots.
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, vectorised over a uint64 array (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard index (int64) of each uint64 ID."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    with np.errstate(over="ignore"):
        return (splitmix64(ids) % np.uint64(num_shards)).astype(np.int64)


def split_by_shard(ids: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Positions into `ids` of each shard's IDs, in order: one argsort, no Python loop over IDs."""
    shards = shard_of(ids, num_shards)
    order = np.argsort(shards, kind="stable")
    bounds = np.searchsorted(shards[order], np.arange(num_shards + 1))
    return [order[bounds[s]:bounds[s + 1]] for s in range(num_shards)]
