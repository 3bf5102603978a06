"""kill -9 of a process in the middle of store mutations loses no acknowledged update.

A child process opens a store, then loops: train lookups (inserts and LRU
moves), an SGD update of a known set of rows with known gradients, and an
acknowledgement line on stdout once `update` has returned. The test kills it
with SIGKILL at a random moment, re-opens the store (dirty stripes are
rebuilt), checks its consistency and that every row holds exactly the value
after its acknowledged steps — or, for rows of the one step in flight, after
one more step.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig
from services.embedding_ps.store import EmbeddingStore, StoreConfig, init_rows

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
DIM, LR, SEED, NUM_TRACKED = 8, 0.1, 3, 2000
CONFIG = StoreConfig(dim=DIM, optimizer=EmbeddingOptimizerConfig(name="sgd", lr=LR), seed=SEED,
                     ps=PSConfig(capacity=1 << 15, num_stripes=8))
TRACKED = np.arange(NUM_TRACKED, dtype=np.uint64) * np.uint64(7) + np.uint64(1)

CHILD = f"""
import sys
import numpy as np
sys.path.insert(0, {str(REPO)!r})
from tests.faults.test_ps_store_crash import CONFIG, TRACKED, grads, updated_at
from services.embedding_ps.store import EmbeddingStore
store = EmbeddingStore.open(sys.argv[1], CONFIG)
store.lookup(TRACKED, train=True)
noise = np.arange(10_000, dtype=np.uint64) + np.uint64(1 << 40)
print("ack 0", flush=True)
step = 0
while True:
    step += 1
    store.lookup(noise[(step * 97) % 9_900:][:100], train=True)
    rows = updated_at(step)
    store.lookup(TRACKED[rows][:500], train=True)
    store.update(TRACKED[rows], grads()[rows])
    sys.stdout.write(f"ack {{step}}\\n")
    sys.stdout.flush()
"""


def grads() -> np.ndarray:
    """Fixed per-row gradients: every step of a row subtracts the same lr * g."""
    g = (np.arange(NUM_TRACKED)[:, None] % 13 + np.arange(DIM)[None, :] + 1) * 1e-3
    return g.astype(np.float32)


def updated_at(step: int) -> np.ndarray:
    """Rows (positions in TRACKED) that step `step` updates: two thirds of them, rotating."""
    return np.flatnonzero((np.arange(NUM_TRACKED) + step) % 3 != 0)


def expected_after(steps: int) -> np.ndarray:
    """Row values after `steps` acknowledged steps, with the store's float32 arithmetic w + (-lr) * g."""
    w = init_rows(TRACKED, dim=DIM, seed=SEED, distribution="uniform", scale=CONFIG.ps.init.scale)
    g = grads()
    for step in range(1, steps + 1):
        rows = updated_at(step)
        w[rows] = w[rows] + np.float32(-LR) * g[rows]
    return w


@pytest.mark.parametrize("kill_after", [3, 40, 250])
def test_kill_9_mid_update_loses_no_acknowledged_row(tmp_path, kill_after):
    directory = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    acked = -1

    def read_acks(lines, stop_at: float) -> None:
        nonlocal acked
        for line in lines:  # other lines are log output
            if line.startswith("ack "):
                acked = int(line.split()[1])
                if acked >= stop_at:
                    return

    try:
        read_acks(child.stdout, kill_after)
        assert acked >= kill_after, f"child exited early with {child.wait()} after {acked} steps"
        time.sleep(np.random.default_rng(kill_after).uniform(0, 0.02))  # land anywhere in the next step
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        read_acks(child.stdout, float("inf"))  # acknowledgements written before the kill still count
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    store = EmbeddingStore.open(directory, CONFIG)
    try:
        store.check_consistency()
        got = store.lookup(TRACKED, train=False)
        done, ahead = expected_after(acked), expected_after(acked + 1)
        # Each value is that of its acknowledged steps, or one step further for the step in flight
        # (compared element by element: the kill may land inside a row).
        ok = (got == done) | (got == ahead)
        bad = np.argwhere(~ok)
        assert not len(bad), f"after {acked} acknowledged steps, rows {np.unique(bad[:, 0])[:10]} are wrong"
        in_flight = updated_at(acked + 1)
        untouched = np.setdiff1d(np.arange(NUM_TRACKED), in_flight)
        np.testing.assert_array_equal(got[untouched], done[untouched])
        stats = store.stats()
        assert stats["evictions"] == 0 and stats["rows"] >= NUM_TRACKED
        # The recovered store keeps working.
        store.update(TRACKED, grads())
        store.lookup(np.arange(5000, dtype=np.uint64), train=True)
        store.check_consistency()
    finally:
        store.close()
