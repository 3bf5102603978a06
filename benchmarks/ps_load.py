"""Bounded load test of one PS shard (loopback only): N concurrent clients doing lookups and updates.

A real `hybridrec serve embedding_ps` process gets, from `clients` independent
gRPC channels, a fixed duration of train lookups of Zipf-distributed IDs drawn
from a key space 50x its capacity (so it fills up and evicts) followed by an
update of the same rows. Reports errors, p50/p99 latency per method, the PS's
resident memory over time and its rows vs capacity.

    python benchmarks/ps_load.py --clients 16 --duration 60 --out results/ps_load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridrec.core.runtime import rpc  # noqa: E402
from hybridrec.core.wire.compress import ValueCodec  # noqa: E402
from hybridrec.core.wire.frames import PSLookup, PSUpdate  # noqa: E402
from hybridrec.app.run.ports import free_port  # noqa: E402

DIM = 16


async def _client(address: str, seed: int, stop_at: float, capacity: int, batch: int, lat: dict, errors: list):
    rng = np.random.default_rng(seed)
    async with rpc.channel(address) as ch:
        lookup = ch.unary_unary("/hybridrec.EmbeddingPS/Lookup")
        update = ch.unary_unary("/hybridrec.EmbeddingPS/Update")
        loop = asyncio.get_running_loop()
        while loop.time() < stop_at:
            ids = np.unique((rng.zipf(1.1, size=batch) + rng.integers(0, 50 * capacity)) % (50 * capacity))
            ids = ids.astype(np.uint64) + np.uint64(1)
            for name, call, frame in (
                ("lookup", lookup, PSLookup({DIM: ids}, train=True).encode()),
                ("update", update, PSUpdate({DIM: ids}, {DIM: rng.standard_normal((ids.size, DIM), np.float32)},
                                            update_id=int(rng.integers(1, 1 << 63))).encode(ValueCodec(fp16=False))),
            ):
                started = time.perf_counter()
                try:
                    await call(frame, timeout=30)
                    lat[name].append(time.perf_counter() - started)
                except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                    errors.append(f"{name}: {exc!r}"[:300])


async def _drive(address: str, clients: int, duration_s: float, capacity: int, batch: int, pid: int) -> dict:
    await rpc.wait_until_serving([address], timeout_s=120)
    lat: dict[str, list[float]] = {"lookup": [], "update": []}
    errors: list[str] = []
    proc = psutil.Process(pid)
    memory: list[tuple[float, int]] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_at = start + duration_s

    async def sample_memory():
        while loop.time() < stop_at:
            memory.append((round(loop.time() - start, 1), proc.memory_info().rss))
            await asyncio.sleep(1.0)

    await asyncio.gather(sample_memory(),
                         *(_client(address, s, stop_at, capacity, batch, lat, errors) for s in range(clients)))
    stats = {}
    async with rpc.channel(address) as ch:
        from hybridrec.core.wire.proto import pb
        reply = await rpc.control_method(ch, "EmbeddingPS", "Stats")(pb.Empty(), timeout=10)
        stats = dict(reply.values)
    return {"lat": lat, "errors": errors, "memory": memory, "ps_stats": stats}


def run_load(*, clients: int = 16, duration_s: float = 60.0, capacity: int = 200_000, batch: int = 2048) -> dict:
    work = Path(tempfile.mkdtemp(prefix="hybridrec-load-"))
    shm = Path(tempfile.mkdtemp(prefix="hybridrec-load-", dir="/dev/shm"))
    address = f"127.0.0.1:{free_port()}"
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": DIM}],
        "ps": {"capacity": capacity, "shm_dir": str(shm), "threads": 2},
        "training": {"compression": {"fp16": True}},
        "cluster": {"ps": [address], "bind_host": "127.0.0.1"},
    }))
    ps = subprocess.Popen([sys.executable, "-m", "hybridrec", "serve", "embedding_ps", "--config", str(config),
                           "--replica", "0"], cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=(work / "ps.log").open("wb"))
    try:
        raw = asyncio.run(_drive(address, clients, duration_s, capacity, batch, ps.pid))
    finally:
        ps.terminate()
        ps.wait(timeout=30)
        import shutil
        shutil.rmtree(shm, ignore_errors=True)
    result = {"clients": clients, "duration_s": duration_s, "capacity": capacity, "batch_ids": batch,
              "errors": len(raw["errors"]), "error_samples": raw["errors"][:5],
              "rows": raw["ps_stats"].get(f"dim{DIM}_rows"), "evictions": raw["ps_stats"].get(f"dim{DIM}_evictions_total"),
              "memory_rss": raw["memory"]}
    for name, values in raw["lat"].items():
        arr = np.asarray(values) * 1e3
        result[f"{name}_count"] = int(arr.size)
        result[f"{name}_p50_ms"] = float(np.percentile(arr, 50)) if arr.size else None
        result[f"{name}_p99_ms"] = float(np.percentile(arr, 99)) if arr.size else None
    rss = [m for t, m in raw["memory"] if t >= duration_s / 2]
    result["rss_growth_second_half"] = (max(rss) / min(rss)) if rss else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run_load(clients=args.clients, duration_s=args.duration, capacity=args.capacity)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "memory_rss"}, indent=2))


if __name__ == "__main__":
    main()
