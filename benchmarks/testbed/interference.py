"""How independent the testbed hosts' CPUs are: dense-math throughput on the trainer's CPUs alone, and while
the embedding host's CPUs run dense math too.

Separate machines do not slow each other down; two vCPUs of one virtual machine can (hyperthreads of one
physical core share its execution units and caches). When they do, work that hybrid training overlaps with
the dense step — the embedding host's lookups, updates and fp16 packing — slows that step, whereas sync
training runs the two one after the other. The sweep records this factor beside its figures so that a
reader can tell a property of the machine from one of the system.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

HOG = ("import os, sys, torch\n"
       "torch.set_num_threads(1); os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\n"
       "a = torch.randn(512, 512)\n"
       "while True: a @ a\n")


def _matmuls_per_s(seconds: float) -> float:
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return n / (time.perf_counter() - start)


def cpu_interference(trainer_cpus: str, embedding_cpus: str, seconds: float = 3.0) -> dict:
    """Matmuls/s of one thread on the trainer's first CPU, alone and with one hog per embedding CPU.

    `ratio` near 1: independent CPUs; well below 1: the hosts share a physical core's resources."""
    import torch

    torch.set_num_threads(1)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(trainer_cpus.split(",")[0].split("-")[0])})
    hogs: list[subprocess.Popen] = []
    try:
        alone = _matmuls_per_s(seconds)
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, cpu]) for cpu in _cpus(embedding_cpus)]
        time.sleep(1.0)
        busy = _matmuls_per_s(seconds)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        os.sched_setaffinity(0, before)
    return {"trainer_alone_matmul_per_s": round(alone, 1), "with_embedding_cpus_busy": round(busy, 1),
            "ratio": round(busy / alone, 3)}


def _cpus(spec: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += [str(c) for c in range(int(lo), int(hi or lo) + 1)]
    return out
