"""The PS's kernel warm-up leaves no scratch store behind, even when its process is killed while it compiles:
the next PS to start removes the directories of warm-ups whose process is gone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

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
