"""On the embedding PS: the embedding lifecycle of one store: rules, counters, the store's clock, expiry and sketch
(docs/architecture.md#embedding-lifecycle).

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
from services.embedding_ps.store_files import H_CLOCK, StoreConfig, as_ids

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


def wall_ms() -> int:
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


class StoreLifecycle:
    """The lifecycle half of `EmbeddingStore` (a mixin: it works on the store's stripes, locks and files).

    Kept here, apart from the request path in store.py, with the rules it applies.
    """

    @property
    def clock(self) -> int:
        """Updates this store applied over all its lives: the unit of step TTLs."""
        return int(self._arrays["header"][H_CLOCK])

    def tick(self, n: int = 1) -> None:
        """Advance the clock by n updates (the servicer ticks every store once per update request)."""
        with self._clock_lock:
            self._arrays["header"][H_CLOCK] += n

    def advance_clock(self, to: int) -> None:
        """Set the clock to `to` if it is behind (a restored checkpoint's rows carry its clock's stamps)."""
        with self._clock_lock:
            header = self._arrays["header"]
            header[H_CLOCK] = max(int(header[H_CLOCK]), int(to))

    def expire(self, *, now_ms: int | None = None) -> int:
        """Remove every row whose table's TTL passed since its last update; returns how many.

        Called periodically by the PS (`ps.lifecycle.sweep_interval_s`); each stripe is swept
        under its own lock, so requests on the other stripes go on meanwhile.
        """
        if not self._rules.expires:
            return 0
        r, now = self._rules, (np.int64(self.clock), np.int64(wall_ms() if now_ms is None else now_ms))

        def run(s: int, lo: int, hi: int) -> int:
            touched, _, tables = self._life[s]
            return K.expire_stripe(*self._stripes[s], touched, tables, self._stamps[s], self._marks[s], r.ttl_clock,
                                   r.ttl_ms, *now)

        return self._run_stripes(np.arange(self.config.num_stripes + 1), run, mutates=True)

    def occurrences(self, ids: np.ndarray) -> np.ndarray:
        """The sketch's count (int64) of each ID since the last halving; 0 everywhere without a sketch."""
        ids = as_ids(ids, "ids")
        out = np.zeros(ids.shape[0], np.int64)
        if not self.config.uses_sketch:
            return out
        perm = np.empty(ids.shape[0], np.int32)
        offsets = K.partition(ids, self.config.num_stripes, perm)

        def run(s: int, lo: int, hi: int) -> int:
            K.sketch_counts_stripe(ids, perm, lo, hi, self._life[s][1], self._rules.sketch_key, out)
            return 0

        self._run_stripes(offsets, run, mutates=False)
        return out

    def sketch(self) -> np.ndarray | None:
        """A copy of the sketch (uint8 (stripes, depth, columns)), None without one."""
        if not self.config.uses_sketch:
            return None
        with self._all_locks():
            return self._arrays["sketch"].copy()

    def merge_sketch(self, dumps: list[np.ndarray]) -> None:
        """Restore the sketch from checkpoint dumps of the same shape (`lifecycle.merge_sketches`)."""
        if not self.config.uses_sketch or not dumps:
            return
        with self._all_locks():
            self._arrays["sketch"][:] = merge_sketches(self._arrays["sketch"], dumps)

    def table_stats(self) -> dict[int, dict[str, int]]:
        """Admitted, rejected and expired rows and dropped gradients per table (group) with any."""
        return table_stats(self._arrays["tables"])

