"""kill -9 in the middle of expiry sweeps and sketch counting loses no acknowledged row of another table.

Like test_ps_store_crash.py, with the embedding lifecycle on: each step of the
child streams IDs of table 1 (admitted from the 2nd occurrence, expiring 3
store updates after their last update), ticks the store's clock and sweeps,
then updates the tracked rows of table 0 (no TTL) and acknowledges. The
sweep's compacting removals move rows between slots, so the test kills the
child at random moments, re-opens the store and checks it is consistent, the
tracked rows hold their acknowledged values, and no table-1 row is older than
its TTL allows.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybridrec.core.config import LifecycleConfig
from services.embedding_ps.store import EmbeddingStore
from tests.faults.test_ps_store_crash import CONFIG, NUM_TRACKED, TRACKED, expected_after

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
TTL = 3
LIFECYCLE_CONFIG = dataclasses.replace(CONFIG, ps=CONFIG.ps.model_copy(update={"lifecycle": LifecycleConfig(
    tables={1: {"admit_after": 2, "ttl_steps": TTL}}, sketch_width=1 << 16)}))

CHILD = f"""
import sys
import numpy as np
sys.path.insert(0, {str(REPO)!r})
from tests.faults.test_ps_lifecycle_crash import LIFECYCLE_CONFIG
from tests.faults.test_ps_store_crash import TRACKED, grads, updated_at
from services.embedding_ps.store import EmbeddingStore
store = EmbeddingStore.open(sys.argv[1], LIFECYCLE_CONFIG)
store.lookup(TRACKED, train=True)
noise = (np.uint64(1) << np.uint64(56)) | (np.arange(20_000, dtype=np.uint64) + np.uint64(1))
print("ack 0", flush=True)
step = 0
while True:
    step += 1
    store.lookup(noise[(step * 397) % 19_000:][:1000], train=True)
    store.tick()
    store.expire()
    rows = updated_at(step)
    store.lookup(TRACKED[rows][:500], train=True)
    store.update(TRACKED[rows], grads()[rows])
    sys.stdout.write(f"ack {{step}}\\n")
    sys.stdout.flush()
"""


@pytest.mark.parametrize("kill_after", [5, 120])
def test_kill_9_mid_sweep_keeps_the_store_and_other_tables_intact(tmp_path, kill_after):
    directory = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    acked = -1
    try:
        for line in child.stdout:
            if line.startswith("ack "):
                acked = int(line.split()[1])
                if acked >= kill_after:
                    break
        assert acked >= kill_after, f"child exited early with {child.wait()} after {acked} steps"
        time.sleep(np.random.default_rng(kill_after).uniform(0, 0.02))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        for line in child.stdout:
            if line.startswith("ack "):
                acked = int(line.split()[1])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    store = EmbeddingStore.open(directory, LIFECYCLE_CONFIG)
    try:
        store.check_consistency()
        got = store.lookup(TRACKED, train=False)
        ok = (got == expected_after(acked)) | (got == expected_after(acked + 1))
        assert ok.all(), f"after {acked} acknowledged steps, tracked rows {np.flatnonzero(~ok.all(axis=1))[:10]}"
        stats = store.stats()
        assert stats["tables"][1]["expired"] > 0 and stats["tables"][1]["rejected"] > 0
        assert stats["rows"] >= NUM_TRACKED
        store.tick()
        store.expire()  # the recovered store keeps expiring: only recent table-1 rows remain
        keys = store.items()[0]
        assert np.count_nonzero(keys >> np.uint64(56) == 1) <= TTL * 1000
        store.check_consistency()
    finally:
        store.close()
