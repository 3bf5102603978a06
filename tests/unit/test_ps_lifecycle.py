"""The embedding lifecycle of a PS store: admission after k occurrences, TTL expiry, their counters,
re-attaching and checkpoints (docs/architecture.md#embedding-lifecycle)."""
from __future__ import annotations

import numpy as np
import pytest

from hybridrec.core.config import ConfigError, EmbeddingOptimizerConfig, PSConfig, from_dict
from hybridrec.core.wire.ids import GROUP_SHIFT
from hybridrec.core.wire.sharding import shard_of
from services.embedding_ps import kernels as K
from services.embedding_ps.checkpoint import dump_shard, load_shard
from services.embedding_ps.store import EmbeddingStore, StoreConfig
from services.embedding_ps.store_files import planned_shm_bytes

SGD = EmbeddingOptimizerConfig(name="sgd", lr=0.1)


def group_ids(group: int, values) -> np.ndarray:
    return (np.uint64(group) << np.uint64(GROUP_SHIFT)) | np.asarray(values, dtype=np.uint64)


def config(lifecycle: dict | None = None, **ps) -> StoreConfig:
    """A store of width 4 with the ps section `ps` and its `lifecycle` (4096 rows in 4 stripes and a sketch
    of 2**16 counters unless they say otherwise)."""
    lifecycle = {"sketch_width": 1 << 16, **(lifecycle or {})}
    return StoreConfig(dim=4, optimizer=SGD, ps=PSConfig(**{"capacity": 4096, "num_stripes": 4, **ps,
                                                           "lifecycle": lifecycle}))


def present(store: EmbeddingStore, ids: np.ndarray) -> np.ndarray:
    return store.peek(ids)[1]


# ------------------------------------------------------------------ admission after k occurrences
def test_an_id_seen_fewer_than_k_times_never_owns_a_row(open_store):
    """Table 1 admits from the 3rd occurrence, table 2 at once; occurrences are train lookups (one per batch)."""
    store = open_store(config(lifecycle={"tables": {1: {"admit_after": 3}}}))
    rng = np.random.default_rng(0)
    gated = group_ids(1, np.arange(1, 3001))
    free = group_ids(2, np.arange(1, 501))
    seen = np.zeros(gated.size, np.int64)
    admitted = rejected = dropped = 0
    for _ in range(12):
        pick = rng.random(gated.size) < 0.3
        batch = np.concatenate([gated[pick], free])
        rows = store.lookup(batch, train=True)
        seen += pick
        # The ID's count reached 3 at this lookup or before: admitted now; else it read zeros
        now_in = pick & (seen >= 3)
        assert np.all(rows[:pick.sum()][~now_in[pick]] == 0)
        assert np.all(rows[:pick.sum()][now_in[pick]] != 0)
        rejected += int((pick & (seen < 3)).sum())
        admitted += int((pick & (seen == 3)).sum())
        # Gradients of IDs without a row are dropped and counted for their table
        applied = store.update(batch, np.ones((batch.size, 4), np.float32))
        dropped += int((pick & (seen < 3)).sum())
        assert applied == batch.size - int((pick & (seen < 3)).sum())
        np.testing.assert_array_equal(present(store, gated), seen >= 3)
    assert np.all(present(store, free))
    np.testing.assert_array_equal(store.occurrences(gated[seen < 3]), seen[seen < 3])  # exact at this load
    tables = store.stats()["tables"]
    assert tables[1] == {"admitted": admitted, "rejected": rejected, "expired": 0, "dropped_gradients": dropped}
    assert tables[2] == {"admitted": free.size, "rejected": 0, "expired": 0, "dropped_gradients": 0}
    assert store.stats()["admission_drops"] == rejected
    store.check_consistency()


def test_probability_is_drawn_after_the_count(open_store):
    store = open_store(config(admit_probability=0.5, lifecycle={"tables": {0: {"admit_after": 2}}}))
    keys = group_ids(0, np.arange(1, 4001))
    store.lookup(keys, train=True)
    assert store.stats()["rows"] == 0  # first occurrence: counted, never drawn
    store.lookup(keys, train=True)
    assert 0.45 < store.stats()["rows"] / keys.size < 0.55


def test_sketch_memory_stays_at_its_bound_under_10m_distinct_ids(open_store, tmp_path):
    """10M distinct IDs, each seen once: the sketch keeps its configured size and keeps rejecting them."""
    cfg = config(capacity=1 << 14, num_stripes=16, lifecycle={
        "sketch_width": 1 << 18, "sketch_depth": 4, "sketch_window": 1 << 18, "tables": {3: {"admit_after": 2}}})
    store = open_store(cfg)
    files = {p.name: p.stat().st_size for p in (tmp_path / "store").iterdir()}
    assert files["sketch.bin"] == (1 << 18) * 4 == store.stats()["sketch_bytes"]
    assert planned_shm_bytes(cfg)["sketch"] == files["sketch.bin"]
    batch = 1 << 16
    total = 10_000_000
    for start in range(0, total, batch):
        store.lookup(group_ids(3, np.arange(start + 1, min(start + batch, total) + 1)), train=True)
    assert {p.name: p.stat().st_size for p in (tmp_path / "store").iterdir()} == files
    stats = store.stats()
    assert stats["sketch_halvings"] >= 30  # aging kept the counters from filling up
    t = stats["tables"][3]
    assert t["admitted"] + t["rejected"] == total
    # Once-seen IDs mostly stay out (5.2% get in by collisions at this window, (1 - e^-load)^depth): the
    # sketch still tells them apart after 10M IDs, where a sketch without aging would admit nearly all.
    assert t["admitted"] < 0.08 * total, t
    assert stats["rows"] <= cfg.capacity


def test_store_without_k_has_no_sketch_or_stamps(open_store, tmp_path):
    store = open_store(config())
    names = {p.name for p in (tmp_path / "store").iterdir()}
    assert "sketch.bin" not in names and "touched.bin" not in names and "tables.bin" in names
    assert store.stats()["sketch_bytes"] == 0 and store.sketch() is None
    assert store.expire() == 0


# ------------------------------------------------------------------ TTL
def test_a_row_untouched_for_the_ttl_is_gone_and_readmitted_when_seen_again(open_store):
    store = open_store(config(lifecycle={"tables": {1: {"ttl_steps": 5, "admit_after": 2}}}))
    old, kept = group_ids(1, np.arange(1, 101)), group_ids(1, np.arange(101, 201))
    both = np.concatenate([old, kept])
    store.lookup(both, train=True)
    first = store.lookup(both, train=True)  # 2nd occurrence: admitted
    assert np.all(present(store, both))
    for step in range(6):
        store.update(kept, np.full((kept.size, 4), 0.1, np.float32))
        store.tick()
        assert store.expire() == (old.size if step == 4 else 0)  # old's last touch was at clock 0
    assert not np.any(present(store, old)) and np.all(present(store, kept))
    assert store.stats()["tables"][1]["expired"] == old.size
    assert store.stats()["rows"] == kept.size
    store.check_consistency()
    again = store.lookup(old, train=True)  # counted twice before: admitted at once, with its initial row
    assert np.all(present(store, old))
    np.testing.assert_array_equal(again, first[:old.size])
    assert store.stats()["tables"][1]["admitted"] == both.size + old.size


def test_ttl_in_seconds_and_per_table(open_store):
    store = open_store(config(lifecycle={"tables": {1: {"ttl_s": 1.0}}}))
    a, b = group_ids(1, np.arange(1, 51)), group_ids(2, np.arange(1, 51))
    store.lookup(np.concatenate([a, b]), train=True)
    import time
    now = time.time_ns() // 1_000_000
    assert store.expire(now_ms=now + 500) == 0
    assert store.expire(now_ms=now + 5000) == a.size  # table 2 has no TTL
    assert not np.any(present(store, a)) and np.all(present(store, b))
    store.check_consistency()


def test_expiry_matches_a_reference_under_churn(open_store):
    """Random lookups, updates, ticks and sweeps, with LRU eviction too: no row outlives its TTL, and the
    index, keys and lists stay consistent through the compacting removals."""
    ttl = 4
    store = open_store(config(capacity=256, lifecycle={"tables": {0: {"ttl_steps": ttl}}}))
    rng = np.random.default_rng(3)
    last: dict[int, int] = {}
    for clock in range(60):
        keys = np.unique(rng.integers(1, 600, 80).astype(np.uint64))
        new = ~present(store, keys)
        store.lookup(keys, train=True)
        assert np.all(present(store, keys))
        updated = rng.random() < 0.7  # some batches' updates are lost: their rows keep aging
        if updated:
            store.update(keys, np.zeros((keys.size, 4), np.float32))
        for k in (keys if updated else keys[new]).tolist():
            last[k] = clock
        store.tick()
        store.expire()
        store.check_consistency()
        alive = {int(k) for k in store.items()[0]}
        assert all(clock + 1 - last[k] < ttl for k in alive)
        if updated:
            assert alive >= set(keys.tolist())  # this batch's rows are fresh
    assert store.stats()["tables"][0]["expired"] > 500


# ------------------------------------------------------------------ crash recovery and checkpoints
def test_reattach_keeps_sketch_clock_stamps_and_counters(tmp_path):
    cfg = config(lifecycle={"tables": {1: {"admit_after": 2, "ttl_steps": 3}}})
    keys = group_ids(1, np.arange(1, 201))
    store = EmbeddingStore.open(tmp_path / "s", cfg)
    store.lookup(keys, train=True)  # counted once
    store.lookup(keys[:50], train=True)  # admitted
    store.tick(2)
    before = store.stats()
    store.close()
    store = EmbeddingStore.open(tmp_path / "s", cfg)
    try:
        assert store.clock == 2 and store.stats()["tables"] == before["tables"]
        np.testing.assert_array_equal(store.occurrences(keys[50:]), 1)
        store.lookup(keys[50:], train=True)  # the count survived: 2nd occurrence admits
        assert np.all(present(store, keys))
        store.tick()
        assert store.expire() == 50  # the first 50 were stamped at clock 0, before the restart
    finally:
        store.close()


def test_reattach_to_a_store_made_without_the_sketch_names_it(tmp_path):
    EmbeddingStore.open(tmp_path / "s", config()).close()
    with pytest.raises(ValueError, match="sketch"):
        EmbeddingStore.open(tmp_path / "s", config(lifecycle={"tables": {1: {"admit_after": 2}}}))


def test_dirty_stripe_rebuild_moves_stamps_with_their_rows(tmp_path):
    cfg = config(capacity=64, num_stripes=1, lifecycle={"tables": {0: {"ttl_steps": 10}}})
    store = EmbeddingStore.open(tmp_path / "s", cfg)
    keys = np.arange(1, 41, dtype=np.uint64)
    for i, k in enumerate(keys):
        store.lookup(np.array([k], np.uint64), train=True)
        store.tick()
    lost = 5  # slot 5 holds key 6, created at clock 5
    hdr = store._stripes[0][5]
    store._stripes[0][1][lost] = K.EMPTY_KEY  # a removal cleared the key, then the process died
    hdr[K.F_DIRTY] = 1
    store.close()
    store = EmbeddingStore.open(tmp_path / "s", cfg)
    try:
        store.check_consistency()
        keep = np.delete(keys, lost)
        assert np.all(present(store, keep))  # rows after the hole moved down one slot, stamps with them
        assert store.clock == 40
        assert store.expire() == 30  # created at clock <= 30: keys 1..31 less the lost one
        np.testing.assert_array_equal(present(store, keep), keep >= 32)
    finally:
        store.close()


def test_checkpoint_round_trip_and_resharding_keep_lifecycle_state(tmp_path):
    cfg = config(num_stripes=2, lifecycle={"tables": {1: {"admit_after": 2, "ttl_steps": 100}}})
    a = EmbeddingStore.open(tmp_path / "a", cfg)
    keys = group_ids(1, np.arange(1, 301))
    a.lookup(keys, train=True)
    a.lookup(keys[:100], train=True)
    a.tick(7)
    a.update(keys[:50], np.zeros((50, 4), np.float32))  # stamped at clock 7
    dump_shard({4: a}, tmp_path / "ckpt", shard=0, num_shards=1, step=3)
    a.close()
    # Same shard count: everything back, including the counts of IDs not admitted yet and the row ages
    b = EmbeddingStore.open(tmp_path / "b", cfg)
    load_shard(tmp_path / "ckpt", {4: b}, shard=0, num_shards=1, shard_of=lambda ids: shard_of(ids, 1))
    assert b.clock == 7 and int(np.sum(present(b, keys))) == 100
    np.testing.assert_array_equal(b.occurrences(keys[100:]), 1)
    b.tick(99)  # clock 106: rows stamped at 0 expire, those updated at 7 do not
    assert b.expire() == 50 and np.all(present(b, keys[:50]))
    b.close()
    # Two target shards: each gets its rows and a sketch that never undercounts
    for shard in range(2):
        c = EmbeddingStore.open(tmp_path / f"c{shard}", cfg)
        load_shard(tmp_path / "ckpt", {4: c}, shard=shard, num_shards=2, shard_of=lambda ids: shard_of(ids, 2))
        mine = keys[shard_of(keys, 2) == shard]
        assert np.all(c.occurrences(mine) >= np.where(np.isin(mine, keys[:100]), 2, 1))
        assert c.clock == 7
        c.close()


# ------------------------------------------------------------------ config
def test_lifecycle_config_resolves_per_table_and_names_bad_keys():
    tree = {"data": {"train": ["x"]},
            "features": [{"name": "a", "group": 0}, {"name": "b", "group": 1}, {"name": "c", "group": 2, "dim": 8}],
            "ps": {"lifecycle": {"admit_after": 2, "ttl_steps": 10, "tables": {1: {"admit_after": 1, "ttl_s": 3}}}},
            "cluster": {"nn_workers": ["127.0.0.1:0"] * 3}}
    cfg = from_dict(tree)
    store16, store8 = StoreConfig.from_config(cfg, 16), StoreConfig.from_config(cfg, 8)
    assert dict(store16.admit_after) == {0: 2} and dict(store8.admit_after) == {2: 2}
    assert dict(store16.ttl_updates) == {0: 30, 1: 30} and dict(store16.ttl_ms) == {1: 3000}
    assert StoreConfig.from_config(from_dict({"data": {"train": ["x"]}}), 16).uses_sketch is False
    for bad, key in (({"admit_after": 0}, "ps.lifecycle.admit_after"),
                     ({"admit_after": 300}, "ps.lifecycle.admit_after"),
                     ({"ttl_steps": -1}, "ps.lifecycle.ttl_steps"),
                     ({"sketch_depth": 9}, "ps.lifecycle.sketch_depth"),
                     ({"tables": {7: {"admit_after": 2}}}, "ps.lifecycle.tables.7"),
                     ({"tables": {1: {"ttl_s": 0}}}, "ps.lifecycle.tables.1.ttl_s")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            from_dict({**tree, "ps": {"lifecycle": bad}})


# ------------------------------------------------------------------ the PS service
def test_ps_service_counts_per_table_ticks_per_update_and_sweeps(tmp_path):
    """A real PS shard servicer: per-table counters in its Stats (the metrics and the run summary read them),
    one clock tick per update request, ttl_steps scaled by the NN worker count, the sweep removing rows."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from hybridrec.core.wire.compress import ValueCodec
    from hybridrec.core.wire.frames import PSLookup, PSUpdate
    from services.embedding_ps.server import EmbeddingPSServicer, open_applied, open_stores
    from services.nn_worker.results import ps_totals

    cfg = from_dict({"data": {"train": ["unused"]},
                     "features": [{"name": "a", "group": 1, "dim": 4}, {"name": "b", "group": 2, "dim": 4}],
                     "cluster": {"ps": ["127.0.0.1:1"], "nn_workers": ["127.0.0.1:2", "127.0.0.1:3"]},
                     "ps": {"shm_dir": str(tmp_path / "shm"), "capacity": 1024, "num_stripes": 2,
                            "lifecycle": {"ttl_steps": 2, "tables": {1: {"admit_after": 2}},
                                          "sweep_interval_s": 0.05}},
                     "optimizer": {"embedding": {"name": "sgd", "lr": 0.1}},
                     "training": {"compression": {"fp16": False}}})
    stores, applied = open_stores(cfg, 0), open_applied(cfg, 0)
    values = ValueCodec(fp16=False)
    a, b = group_ids(1, np.arange(1, 11)), group_ids(2, np.arange(1, 6))
    batch = np.concatenate([a, b])
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        ps = EmbeddingPSServicer(stores, applied, 0, 1, values, executor)
        assert stores[4].config.ttl_updates == {1: 4, 2: 4}  # 2 steps x 2 NN workers

        async def scenario():
            await ps.Lookup(PSLookup({4: batch}, train=True).encode(), None)
            grads = np.ones((batch.size, 4), np.float32)
            await ps.Update(PSUpdate({4: batch}, {4: grads}, 7).encode(values), None)
            stats = ps.stats()
            assert stats["table1_rejected_total"] == 10 and stats["table1_dropped_gradients_total"] == 10
            assert stats["table2_admitted_total"] == 5 and stats["dim4_rows"] == 5
            assert stats["dim4_sketch_bytes"] == stores[4].stats()["sketch_bytes"] > 0
            await ps.Lookup(PSLookup({4: a}, train=True).encode(), None)  # 2nd occurrence of a: admitted
            assert ps.stats()["table1_admitted_total"] == 10
            for uid in range(8, 12):
                await ps.Update(PSUpdate({4: a}, {4: np.ones((a.size, 4), np.float32)}, uid).encode(values), None)
            assert stores[4].clock == 5
            sweeper = asyncio.ensure_future(ps.sweep_expired(cfg.ps.lifecycle.sweep_interval_s))
            deadline = asyncio.get_running_loop().time() + 30
            while ps.stats()["table2_expired_total"] < 5 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)  # a few sweeps (a loaded machine can stall one)
            await asyncio.sleep(0.15)  # and a few more: they expire nothing else
            sweeper.cancel()
            stats = ps.stats()
            assert stats["table2_expired_total"] == 5 and stats["dim4_rows"] == 10  # b untouched since clock 0
            # What the run summary makes of two such shards: their typed Stats, not the metrics' names
            recovery = (await ps.Stats(None, None)).recovery
            assert dict(recovery.rows_by_width) == {4: 10} and recovery.updates_deduplicated == 0
            totals = ps_totals([recovery, recovery])
            assert totals["ps_rows"] == 20 and totals["updates_deduplicated"] == 0
            assert totals["lifecycle"][1].model_dump() == {"admitted": 20, "rejected": 20, "expired": 0,
                                                          "dropped_gradients": 20}
            assert totals["lifecycle"][2].expired == 10
            assert totals["disk_tier"] is None  # no ps.tier
            assert ps_totals(None) == {"updates_deduplicated": None, "ps_rows": None, "lifecycle": None,
                                       "disk_tier": None}

        asyncio.run(scenario())
    finally:
        executor.shutdown(wait=True)
        for store in stores.values():
            store.close()
        applied.close()
