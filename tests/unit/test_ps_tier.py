"""The PS store's disk tier (services/embedding_ps/tier.py): a store whose memory holds a fraction of the table
trains exactly as one that holds all of it, loses no gradient, reads disk rows for serving, checkpoints and
restores both tiers, survives SIGKILL, and refuses a tier it cannot trust. Real stores, real files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from hybridrec.core.layouts import checkpoints
from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig
from hybridrec.core.wire.sharding import shard_of
from services.embedding_ps import kernels as K
from services.embedding_ps.checkpoint import dump_shard, load_shard
from services.embedding_ps.store import EmbeddingStore, StoreConfig
from services.embedding_ps.tier import CorruptTier, TierLayout
from tests.conftest import REPO

ADAGRAD = EmbeddingOptimizerConfig(name="adagrad", lr=0.05)
DIM = 8
TABLE = 3000


def cfg(tmp_path: Path, capacity: int, *, tier_capacity: int | None = TABLE + 500, dim: int = DIM,
        optimizer: EmbeddingOptimizerConfig = ADAGRAD, **ps) -> StoreConfig:
    tier = {"tier": {"dir": str(tmp_path / "disk"), "capacity": tier_capacity}} if tier_capacity else {}
    return StoreConfig(dim=dim, optimizer=optimizer, seed=5, ps=PSConfig(capacity=capacity, num_stripes=4, **tier, **ps))


@pytest.fixture
def stores(tmp_path):
    """stores(name, config) -> a store under tmp_path/shm/shard-00000/<name> (its tier under tmp_path/disk)."""
    opened = []

    def make(name: str, config: StoreConfig) -> EmbeddingStore:
        store = EmbeddingStore.open(tmp_path / "shm" / "shard-00000" / name, config)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def train(store: EmbeddingStore, steps: int, seed: int = 0) -> None:
    """Zipf batches over TABLE IDs: a training lookup, then an update of every ID looked up."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.unique(rng.zipf(1.2, 400).astype(np.uint64) % TABLE + 1)
        rows = store.lookup(ids, train=True)
        assert store.update(ids, (rows * 0.1 + 0.01).astype(np.float32)) == ids.size


def table(store: EmbeddingStore) -> dict[int, bytes]:
    keys, values = store.items()
    assert len(set(keys.tolist())) == len(keys), "a key came out of both tiers"
    return {int(k): v.tobytes() for k, v in zip(keys, values)}


@pytest.mark.parametrize("storage", ["fp32", "fp16"])
def test_a_quarter_in_memory_trains_exactly_as_all_in_memory(tmp_path, stores, storage):
    """Bit for bit, with 16-bit weights too: a row's rounding draws depend on its key and its stripe's update
    count, not on the tier it is in."""
    whole = stores("whole", cfg(tmp_path, TABLE + 500, tier_capacity=None, storage=storage))
    tiered = stores("tiered", cfg(tmp_path, TABLE // 4, storage=storage))
    for store in (whole, tiered):
        train(store, 150)
    assert table(tiered) == table(whole)
    st = tiered.stats()
    assert st["rows"] == TABLE // 4 and st["missing_updates"] == 0
    tier = st["tier"]
    assert tier["fills"] > 0 and tier["writebacks"] >= tier["fills"] and tier["overflows"] == 0, tier
    assert tier["rows"] + st["rows"] >= len(table(whole)) and 0 < tier["memory_hit_rate"] < 1
    assert st["tables"].get(0, {}).get("dropped_gradients", 0) == 0
    probe = np.arange(1, TABLE + 200, dtype=np.uint64)  # read-only reads and peeks see the rows on disk
    np.testing.assert_array_equal(tiered.lookup(probe, train=False), whole.lookup(probe, train=False))
    for state in (False, True):
        got, want = tiered.peek(probe, state=state), whole.peek(probe, state=state)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert tiered.stats()["tier"]["disk_reads"] > 0


def test_a_gradient_for_a_row_evicted_since_its_lookup_is_applied_on_disk(tmp_path, stores):
    whole = stores("whole", cfg(tmp_path, 1000, tier_capacity=None))
    tiered = stores("tiered", cfg(tmp_path, 64))
    first, others = np.arange(1, 41, dtype=np.uint64), np.arange(100, 400, dtype=np.uint64)
    for store in (whole, tiered):
        store.lookup(first, train=True)
        store.lookup(others, train=True)  # evicts every row of `first` from the tiered store's memory
    assert tiered.stats()["tier"]["writebacks"] >= 40  # 300 new rows through 64 slots: all of `first` left
    grads = np.linspace(-1, 1, 40 * DIM, dtype=np.float32).reshape(40, DIM)
    assert whole.update(first, grads) == tiered.update(first, grads) == 40
    st = tiered.stats()
    assert st["missing_updates"] == 0 and st["tier"]["disk_updates"] == 40
    assert st["tables"].get(0, {}).get("dropped_gradients", 0) == 0
    np.testing.assert_array_equal(tiered.peek(first, state=True)[0], whole.peek(first, state=True)[0])


def test_an_id_on_disk_is_not_drawn_for_admission_again(tmp_path, stores):
    store = stores("tiered", cfg(tmp_path, 64, admit_probability=0.25))
    keys = np.arange(1, 2001, dtype=np.uint64)
    for _ in range(12):  # each lookup draws again: most IDs get a row
        store.lookup(keys, train=True)
    admitted = keys[store.peek(keys)[1]]
    assert admitted.size > 1000 and store.stats()["tier"]["writebacks"] > 0
    before = store.peek(admitted, state=True)[0]
    drops = store.stats()["admission_drops"]
    rows = store.lookup(admitted, train=True)  # mostly on disk: filled, none drawn, none reading zeros
    assert store.stats()["admission_drops"] == drops
    np.testing.assert_array_equal(rows, before[:, :DIM])


def test_checkpoints_cover_both_tiers_and_restore_into_either_kind_of_store(tmp_path, stores):
    root = tmp_path / "ckpt"
    src = stores("src", cfg(tmp_path, 200))
    train(src, 60, seed=1)
    full = dump_shard({DIM: src}, checkpoints.step_dir(root, 10), shard=0, num_shards=1, step=10)
    assert not full["delta"] and full["tables"][str(DIM)]["num_rows"] == len(table(src))
    train(src, 2, seed=2)  # under half the rows change: the next dump is a delta
    assert 0 < src.changed_rows() < len(table(src)) // 2
    delta = dump_shard({DIM: src}, checkpoints.step_dir(root, 20), shard=0, num_shards=1, step=20, base=10,
                       full_every=4)
    assert delta["delta"] and delta["chain"] == [10, 20]
    assert delta["tables"][str(DIM)]["num_rows"] < full["tables"][str(DIM)]["num_rows"]
    want = table(src)
    for name, config in (("into-tier", cfg(tmp_path, 200)), ("into-memory", cfg(tmp_path, 4000, tier_capacity=None))):
        dst = stores(name, config)
        load_shard(checkpoints.step_dir(root, 20), {DIM: dst}, shard=0, num_shards=1,
                   shard_of=lambda ids: shard_of(ids, 1))
        assert table(dst) == want, name
        if dst.tier is not None:  # restored onto disk in file order, not through memory's evictions
            assert dst.stats()["rows"] == 0 and dst.stats()["tier"]["writebacks"] == 0
            train(dst, 3)  # and it trains on, filling memory from disk
            assert dst.stats()["tier"]["fills"] > 0


def test_load_cold_writes_rows_to_disk_and_keeps_memory_rows_newest(tmp_path, stores):
    store = stores("tiered", cfg(tmp_path, 64))
    store.lookup(np.arange(1, 11, dtype=np.uint64), train=True)
    keys = np.arange(1, 1001, dtype=np.uint64)
    values = np.arange(1000 * 16, dtype=np.float32).reshape(1000, 16)
    assert store.load_cold(keys, values) == 990  # 1..10 are in memory: overwritten there
    got, found = store.peek(keys, state=True)
    assert found.all()
    np.testing.assert_array_equal(got, values)
    assert store.stats()["rows"] == 10 and store.stats()["tier"]["rows"] == 990
    with pytest.raises(ValueError, match="no disk tier"):
        stores("memory-only", cfg(tmp_path, 64, tier_capacity=None)).load_cold(keys, values)


def test_a_sigkilled_process_loses_no_acknowledged_update_on_either_tier(tmp_path):
    """A child trains a tiered store and reports each finished step; it is killed with SIGKILL while it waits
    after step 40. Reopened, the store holds every row of a run of exactly 40 steps."""
    config_args = f"{str(tmp_path)!r}"
    child = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from tests.unit.test_ps_tier import cfg, train
        from services.embedding_ps.store import EmbeddingStore
        tmp = Path({config_args})
        store = EmbeddingStore.open(tmp / "shm" / "shard-00000" / "killed", cfg(tmp, 200))
        for step in range(1000):
            train(store, 1, seed=step)
            print(step + 1, flush=True)
            if step + 1 == 40:
                sys.stdin.readline()  # waits here until killed
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        for line in proc.stdout:
            if line.strip() == "40":
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    reference = EmbeddingStore.open(tmp_path / "ref", cfg(tmp_path, 4000, tier_capacity=None))
    killed = EmbeddingStore.open(tmp_path / "shm" / "shard-00000" / "killed", cfg(tmp_path, 200))
    try:
        for step in range(40):
            train(reference, 1, seed=step)
        killed.check_consistency()
        assert killed.stats()["tier"]["writebacks"] > 0
        assert table(killed) == table(reference)
    finally:
        killed.close()
        reference.close()


# ------------------------------------------------------------------ refusals
def test_a_tier_without_room_is_refused_naming_path_and_bytes(tmp_path, stores):
    huge = 10**13
    with pytest.raises(ValueError, match=r"disk tier .*disk.* needs \d+ bytes .* filesystem has \d+ bytes free"):
        stores("huge", cfg(tmp_path, 64, tier_capacity=huge))


@pytest.mark.parametrize("change, named", [
    ({"dim": 4}, "dim"), ({"optimizer": EmbeddingOptimizerConfig(name="sgd")}, "row_width"),
    ({"tier_capacity": TABLE + 600}, "capacity"),
])
def test_a_tier_left_by_another_table_is_refused_naming_the_difference(tmp_path, stores, change, named):
    store = stores("t", cfg(tmp_path, 64))
    train(store, 5)
    store.close()
    with pytest.raises(ValueError, match=f"was made for {named}=.* but the config asks for {named}="):
        # the memory store's own check would name dim first: open the tier alone, as a re-attaching store does
        from services.embedding_ps.tier import DiskTier
        DiskTier.open(tmp_path / "disk" / "shard-00000" / "t", cfg(tmp_path, 64, **change), fresh=False)


@pytest.mark.parametrize("damage", ["description", "truncated", "counters", "missing"])
def test_a_corrupt_tier_is_refused_at_open(tmp_path, stores, damage):
    store = stores("t", cfg(tmp_path, 64))
    train(store, 5)
    store.close()
    tier = tmp_path / "disk" / "shard-00000" / "t"
    if damage == "missing":  # the disk was wiped, the memory (shared memory) kept
        import shutil
        shutil.rmtree(tier)
    elif damage == "description":
        (tier / "tier.json").write_text("{not json")
    elif damage == "truncated":
        os.truncate(tier / "records.bin", 4096)
    else:
        counters = np.memmap(tier / "header.bin", np.int64, mode="r+")
        counters[K.TF_ROWS] = -5
        counters.flush()
        del counters
    with pytest.raises(CorruptTier):
        EmbeddingStore.open(tmp_path / "shm" / "shard-00000" / "t", cfg(tmp_path, 64))


def test_turning_the_tier_on_or_off_for_an_existing_store_is_refused(tmp_path, stores):
    store = stores("t", cfg(tmp_path, 64, tier_capacity=None))
    store.lookup(np.arange(1, 50, dtype=np.uint64), train=True)
    store.close()
    with pytest.raises(ValueError, match="created with disk tier .*=0, but the config asks for disk tier .*=1"):
        stores("t", cfg(tmp_path, 64))


def test_a_store_created_afresh_does_not_reattach_an_old_tier(tmp_path, stores):
    store = stores("t", cfg(tmp_path, 64))
    train(store, 5)
    assert store.stats()["tier"]["rows"] > 0
    store.close()
    import shutil
    shutil.rmtree(tmp_path / "shm" / "shard-00000" / "t")  # the memory is gone (a reboot): its tier is stale
    again = stores("t", cfg(tmp_path, 64))
    assert again.stats()["tier"]["rows"] == 0 and again.stats()["rows"] == 0


@pytest.mark.parametrize("ps, message", [
    ({"capacity": 5000}, "ps.tier.capacity .* must be larger than ps.capacity"),
    ({"lifecycle": {"ttl_s": 60.0}}, "cannot be used with ps.lifecycle TTLs"),
    ({"replicas": 2}, "cannot be used with ps.replicas"),
])
def test_the_config_refuses_what_the_tier_cannot_do(tmp_path, ps, message):
    with pytest.raises(ValidationError, match=message):
        PSConfig(**{"capacity": 64, "tier": {"dir": str(tmp_path), "capacity": 4000}, **ps})


def test_the_layout_sizes_pages_for_the_row(tmp_path):
    layout = TierLayout.of(cfg(tmp_path, 64, tier_capacity=1_000_000, dim=16))
    assert layout.row_width == 32 and layout.per_page == 4096 // (8 + 128) == 30
    assert layout.pages * layout.per_page * 0.85 >= 1_000_000 and layout.nbytes == layout.pages * 4096
    assert json.loads(json.dumps(layout.__dict__))["capacity"] == 1_000_000
