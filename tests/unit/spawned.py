"""Run a function as `world` spawned ranks (real processes, one torch.distributed group on loopback).

Each rank is `target(rank, port, out_dir)`; it writes its results under `out_dir` and a traceback to
`*.err` when it fails. A hang fails the test after `timeout_s` instead of blocking the suite.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from pathlib import Path

from hybridrec.app.run.ports import free_port


def _rank(target, rank: int, port: int, out: str) -> None:
    """`target` in a spawned rank, leaving without the interpreter's teardown once it returned, as the NN
    worker does: torch.distributed's background threads can abort the process in static destructors
    ("terminate called without an active exception", SIGABRT), which a loaded CI machine hit here once."""
    try:
        target(rank, port, out)
    except BaseException:  # noqa: BLE001 - reported through the exit code and *.err
        Path(out, f"rank{rank}-spawned.err").write_text(traceback.format_exc())
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(target, world: int, out: Path, timeout_s: float) -> None:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(target, rank, port, str(out)), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = "\n".join(f.read_text() for f in sorted(Path(out).glob("*.err")))
    assert not hung, f"ranks {hung} still running after {timeout_s} s\n{errors}"
    assert [p.exitcode for p in procs] == [0] * world, errors
