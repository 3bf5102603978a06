"""On the embedding PS: the embedding lifecycle's rules and counters of one store (docs/architecture.md#embedding-lifecycle).

Per table (a feature group, the top 8 bits of an ID): an ID gets a row only
after `admit_after` occurrences, counted in a count-min sketch that lives in
the store's `sketch.bin` (fixed size: sketch_width x sketch_depth one-byte
counters, whatever the number of IDs), and a row not updated for the table's
TTL (store updates or milliseconds) is removed by `EmbeddingStore.expire`.
The kernels take the rules as arrays indexed by group (`kernels.py`), so no
Python code runs per ID; this module builds those arrays from a `StoreConfig`
and turns the per-table counters of `tables.bin` into stats.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from services.embedding_ps import kernels as K
from services.embedding_ps.store_files import StoreConfig

_SKETCH_SALT = 0x5CE7C4
TABLE_COUNTERS = {"admitted": K.T_ADMITTED, "rejected": K.T_REJECTED, "expired": K.T_EXPIRED,
                  "dropped_gradients": K.T_DROPPED}
"""Name of each per-table counter (stats, metrics and the run summary) -> its field in tables.bin."""


@dataclass(frozen=True)
class Rules:
    """A store's lifecycle settings as the kernels read them: one entry per group (table)."""

    admit_after: np.ndarray
    """int64 (256,): occurrences needed before a row (1: at once)."""
    ttl_clock: np.ndarray
    """int64 (256,): store updates without an update after which a row expires (0: never)."""
    ttl_ms: np.ndarray
    """int64 (256,): milliseconds without an update after which a row expires (0: never)."""
    sketch_key: np.uint64
    """Seed of the sketch's hash (a numpy scalar: see EmbeddingStore's numba note)."""
    window: np.int64
    """Occurrences a stripe counts before halving its sketch counters."""

    @property
    def expires(self) -> bool:
        return bool(self.ttl_clock.any() or self.ttl_ms.any())


def rules_of(config: StoreConfig) -> Rules:
    """The kernels' arrays for `config` (tables it does not name: admit at once, never expire)."""
    def per_group(values: dict[int, int], default: int) -> np.ndarray:
        out = np.full(K.NUM_TABLES, default, np.int64)
        for group, value in values.items():
            out[group] = value
        return out

    return Rules(admit_after=per_group(dict(config.admit_after), 1), ttl_clock=per_group(dict(config.ttl_updates), 0),
                 ttl_ms=per_group(dict(config.ttl_ms), 0),
                 sketch_key=np.uint64(K.mix_seed(config.seed, _SKETCH_SALT)),
                 window=np.int64(config.stripe_window))


def now_ms() -> int:
    """Wall-clock milliseconds: the unit of time TTLs (rows stamped before a restart keep aging)."""
    return time.time_ns() // 1_000_000


def table_stats(tables: np.ndarray) -> dict[int, dict[str, int]]:
    """Per-table counters summed over stripes, for the tables that have any: {group: {name: count}}."""
    totals = tables.sum(axis=0)
    return {int(g): {name: int(totals[g, field]) for name, field in TABLE_COUNTERS.items()}
            for g in np.flatnonzero(totals.any(axis=1))}


def merge_sketches(own: np.ndarray, dumps: list[np.ndarray]) -> np.ndarray:
    """A sketch for a store restored from checkpoint dumps of the same shape.

    The dumps count disjoint parts of the stream (each shard's IDs), so their
    counters add up (saturating at 255); the store's own counters already hold
    what it counted itself, so the result is the larger of the two per counter:
    never below any ID's true count, as a count-min sketch must be.
    """
    total = np.zeros(own.shape, np.int64)
    for dump in dumps:
        total += dump
    return np.maximum(own, np.minimum(total, 255)).astype(np.uint8)
