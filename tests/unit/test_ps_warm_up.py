"""The PS's kernel warm-up leaves no scratch store behind, even when its process is killed while it compiles:
the next PS to start removes the directories of warm-ups whose process is gone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.embedding_ps.server import WARM_UP_PREFIX, remove_stale_warm_ups


def test_stale_warm_ups_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f"{WARM_UP_PREFIX}{dead.pid}-x1y2"
        running = tmp_path / f"{WARM_UP_PREFIX}{alive.pid}-a3b4"
        mine = tmp_path / f"{WARM_UP_PREFIX}{os.getpid()}-c5d6"
        foreign = tmp_path / f"{WARM_UP_PREFIX}notapid"
        for path in (stale, running, mine, foreign):
            (path / "dim-16").mkdir(parents=True)
            (path / "dim-16" / "values").write_bytes(b"\0" * 64)
        assert remove_stale_warm_ups(tmp_path) == [stale]
        assert not stale.exists() and running.exists() and mine.exists() and foreign.exists()
    finally:
        alive.send_signal(signal.SIGKILL)
        alive.wait()


def test_a_warm_up_names_its_process(tmp_path, monkeypatch):
    """What the sweep relies on: the scratch directory carries the PS's pid."""
    import tempfile

    from hybridrec.core.config import Config
    from services.embedding_ps import server

    seen = []
    real = tempfile.TemporaryDirectory

    def spy(*args, **kwargs):
        seen.append(kwargs.get("prefix"))
        return real(*args, **{**kwargs, "dir": str(tmp_path)})

    monkeypatch.setattr(server.tempfile, "TemporaryDirectory", spy)
    server.warm_up(Config.model_validate({"data": {"train": ["unused"]}, "ps": {"capacity": 1024, "num_stripes": 2}}))
    assert seen and all(prefix == f"{WARM_UP_PREFIX}{os.getpid()}-" for prefix in seen)
    assert not list(tmp_path.iterdir())


def test_a_warm_up_works_inside_the_runs_shared_memory(tmp_path, monkeypatch):
    """Its scratch store is under ps.shm_dir, which the launcher (or, when the launcher is killed, its fork
    server) removes with the run: a PS killed while warming up leaves nothing behind in /dev/shm."""
    from hybridrec.core.config import Config
    from services.embedding_ps import server

    where = []
    real = server.EmbeddingStore.open
    monkeypatch.setattr(server.EmbeddingStore, "open", lambda path, cfg: where.append(path) or real(path, cfg))
    shm = tmp_path / "run-shm"
    server.warm_up(Config.model_validate({"data": {"train": ["unused"]},
                                          "ps": {"capacity": 1024, "num_stripes": 2, "shm_dir": str(shm)}}))
    assert where and all(path.parent.parent == shm and path.parent.name.startswith(WARM_UP_PREFIX)
                         for path in where), where
    assert list(shm.iterdir()) == []  # and it removes it when done


TRAIN_AFTER_WARM_UP = r"""
import json, sys
import numpy as np
from numba.core.dispatcher import Dispatcher
from hybridrec.core.config import Config
from services.embedding_ps import server

def signatures():
    '''Signatures each numba kernel of the PS and its wire holds in this process (compiled or loaded).'''
    return {f"{name}.{attr}": len(obj.signatures) for name, module in list(sys.modules.items())
            if name.startswith(("services.embedding_ps", "hybridrec.core.wire")) and module is not None
            for attr, obj in vars(module).items() if isinstance(obj, Dispatcher)}

config = Config.model_validate(json.loads(sys.argv[1]))
server.warm_up(config, updates_first=sys.argv[2] == "updates-first")
before = signatures()
stores = server.open_stores(config, 0)
rng = np.random.default_rng(0)
for round_no in range(3):
    for dim, store in stores.items():
        ids = rng.integers(1, 3 * config.ps.capacity, 4000, dtype=np.uint64)  # new rows, evictions, duplicates
        store.lookup(ids, train=True)
        store.update(ids, rng.standard_normal((ids.size, dim)).astype(np.float32))
        store.lookup(ids[::3], train=False)
        store.expire()
        for _ in store.stream_rows(changed_only=round_no > 0):
            pass
after = signatures()
print(json.dumps({k: [before.get(k, 0), n] for k, n in after.items() if n != before.get(k, 0)}))
"""


INSERTS_THEN_LOOKUP = r"""
import json, sys
import numpy as np
from hybridrec.core.config import Config
from services.embedding_ps import kernels as K, server

config = Config.model_validate(json.loads(sys.argv[1]))
store = server.open_stores(config, 0)[16]
store.compile_inserts()
held = [str(sig) for sig in K.insert_misses.signatures]
store.lookup(np.arange(1, 5000, dtype=np.uint64), train=True)  # new rows: lookup_stripe calls insert_misses
print(json.dumps({"compiled": held, "after_lookup": [str(sig) for sig in K.insert_misses.signatures],
                  "inserted": int(store.stats()["inserts"])}))
"""


@pytest.mark.parametrize("ps", [{}, {"tier": {"capacity": 50_000}}], ids=["fp32", "disk-tier"])
def test_compile_inserts_compiles_the_signature_a_lookup_calls(tmp_path, ps):
    """`compile_inserts` (what an odd shard's warm-up does first) compiles the inserts' kernel with the very
    argument types `lookup_stripe` (or a tiered store's own call) passes it: a lookup of new rows afterwards adds
    no signature, so the warm-up's split of the compile between two processes compiles nothing twice."""
    if "tier" in ps:
        ps = {"tier": {**ps["tier"], "dir": str(tmp_path / "tier")}}
    config = {"data": {"train": ["unused.tsv"]}, "ps": {"shm_dir": str(tmp_path / "shm"), "capacity": 2048, **ps}}
    done = subprocess.run([sys.executable, "-c", INSERTS_THEN_LOOKUP, json.dumps(config)], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["compiled"]) == 1 and result["after_lookup"] == result["compiled"], result
    assert result["inserted"] > 0


@pytest.mark.parametrize("ps,order", [({}, "lookups-first"), ({}, "updates-first"),
                                      ({"storage": "fp16"}, "lookups-first"),
                                      ({"tier": {"capacity": 50_000}}, "lookups-first"),
                                      ({"tier": {"capacity": 50_000}}, "updates-first"),
                                      ({"lifecycle": {"admit_after": 2, "ttl_steps": 3}}, "lookups-first")],
                         ids=["fp32", "fp32-updates-first", "fp16", "disk-tier", "disk-tier-updates-first",
                              "admission-and-ttl"])
def test_after_its_warm_up_a_ps_compiles_nothing_while_it_trains(tmp_path, ps, order):
    """The warm-up compiles every kernel a PS of this configuration calls while it trains, checkpoints and
    serves reads, for the argument types the real stores pass (a float32 store's kernels take `storage` and
    `tier` as None, others an integer and a tuple: different signatures): in a fresh process, the PS's kernels
    hold the same signatures after thousands of lookups, updates, evictions, expiries and checkpoints of a
    real shard as after its warm-up. A kernel compiled on a request would stall it for seconds. Both orders of
    the warm-up: an odd shard begins with the inserts' and the updates' kernels (`compile_inserts`)."""
    if "tier" in ps:
        ps = {"tier": {**ps["tier"], "dir": str(tmp_path / "tier")}}
    config = {"data": {"train": ["unused.tsv"]}, "ps": {"shm_dir": str(tmp_path / "shm"), "capacity": 2048, **ps}}
    if "storage" in ps:
        config["optimizer"] = {"embedding": {"name": "rowwise_adagrad", "lr": 0.05}}
    done = subprocess.run([sys.executable, "-c", TRAIN_AFTER_WARM_UP, json.dumps(config), order], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
