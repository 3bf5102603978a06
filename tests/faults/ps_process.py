"""A real `hybridrec serve embedding_ps` process for the fault tests, and a lookup that reports its status."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import yaml

from hybridrec.core.runtime import rpc
from hybridrec.core.wire.frames import PSLookup
from hybridrec.app.run.ports import free_port
from tests.conftest import HYBRIDREC, REPO


@contextlib.contextmanager
def ps_process(tmp_path: Path, **cluster) -> Iterator[tuple[str, subprocess.Popen]]:
    """One PS shard (width 8, checkpoint root tmp_path/root) on a free loopback port; stopped on exit."""
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": 8}],
        "ps": {"capacity": 1000, "num_stripes": 2, "shm_dir": str(tmp_path / "shm")},
        "checkpoint": {"dir": str(tmp_path / "root")},
        "cluster": {"ps": [address], "bind_host": "127.0.0.1", **cluster},
    }))
    proc = subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--config", str(config), "--replica", "0"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp_path / "ps.log").open("wb"))
    try:
        yield address, proc
    finally:
        rpc.use_tls(None)
        proc.terminate()
        proc.wait(timeout=30)


async def lookup_status(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """The status of a small train lookup on `channel` (OK, or the code it was refused with)."""
    try:
        await rpc.raw_method(channel, "EmbeddingPS", "Lookup")(
            PSLookup({8: np.arange(1, 5, dtype=np.uint64)}, train=True).encode(), timeout=30)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
