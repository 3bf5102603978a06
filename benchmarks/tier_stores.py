"""The disk tier's store against the embedded key-value stores it could have been: RocksDB (rocksdict) and LMDB.

Run: python benchmarks/tier_stores.py --out tier_stores.json
     (the candidates need `pip install rocksdict lmdb`; one not installed is reported as such, not measured)

Each store gets --rows rows of 32 float32 values (width 16 with Adagrad state) keyed by uint64, then, --repeats
times, a batch of --batch random keys is read (as a lookup's rows not in memory are) and written back (as
evicted rows are), in microseconds per row. The files live under --dir, small enough to stay in the page
cache: this measures what each costs the PS's CPU per row, not the disk (docs/benchmarks.md#disk-tier has
the disk's own rate). The tier is read through `EmbeddingStore.peek` (its kernels, without the page advice a
lookup adds) and written through `load_cold`; the candidates take one Python bytes object per key and value
at their APIs, so their batches are built and split in Python, as a PS using them would have to.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig  # noqa: E402
from services.embedding_ps.store import EmbeddingStore, StoreConfig  # noqa: E402

WIDTH = 32


def _per_row(seconds: float, rows: int) -> float:
    return round(seconds / rows * 1e6, 3)


def tier(root: Path, keys: np.ndarray, values: np.ndarray, batch: np.ndarray, repeats: int) -> dict:
    config = StoreConfig(dim=16, optimizer=EmbeddingOptimizerConfig(name="adagrad"),
                         ps=PSConfig(capacity=64, num_stripes=16,
                                     tier={"dir": str(root / "tier"), "capacity": int(keys.size * 1.1)}))
    with EmbeddingStore.open(root / "shm" / "shard-00000" / "dim-16", config) as store:
        store.load_cold(keys[:100], values[:100])  # compiled before the clock starts
        store.peek(batch[:10], state=True)
        started = time.perf_counter()
        store.load_cold(keys, values)
        load = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(repeats):
            rows, found = store.peek(batch, state=True)
        get = time.perf_counter() - started
        assert found.all() and np.array_equal(rows, values[batch - 1])
        started = time.perf_counter()
        for _ in range(repeats):
            store.load_cold(batch, values[batch - 1])
        put = time.perf_counter() - started
    return {"load_us_per_row": _per_row(load, keys.size), "get_us_per_row": _per_row(get, repeats * batch.size),
            "put_us_per_row": _per_row(put, repeats * batch.size)}


def _pairs(keys: np.ndarray, values: np.ndarray):
    kb, vb, step = keys.tobytes(), values.tobytes(), 4 * WIDTH
    return ((kb[8 * i:8 * i + 8], vb[step * i:step * (i + 1)]) for i in range(keys.size))


def rocksdb(root: Path, keys: np.ndarray, values: np.ndarray, batch: np.ndarray, repeats: int) -> dict:
    from rocksdict import Options, Rdict, WriteBatch

    db = Rdict(str(root / "rocks"), Options(raw_mode=True))

    def write(k: np.ndarray, v: np.ndarray) -> None:
        wb = WriteBatch(raw_mode=True)
        for key, value in _pairs(k, v):
            wb.put(key, value)
        db.write(wb)

    try:
        started = time.perf_counter()
        for lo in range(0, keys.size, 100_000):
            write(keys[lo:lo + 100_000], values[lo:lo + 100_000])
        load = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(repeats):
            kb = batch.tobytes()
            rows = np.frombuffer(b"".join(db[[kb[8 * i:8 * i + 8] for i in range(batch.size)]]), np.float32)
        get = time.perf_counter() - started
        assert np.array_equal(rows.reshape(-1, WIDTH), values[batch - 1])
        started = time.perf_counter()
        for _ in range(repeats):
            write(batch, values[batch - 1])
        put = time.perf_counter() - started
    finally:
        db.close()
    return {"load_us_per_row": _per_row(load, keys.size), "get_us_per_row": _per_row(get, repeats * batch.size),
            "put_us_per_row": _per_row(put, repeats * batch.size)}


def lmdb_store(root: Path, keys: np.ndarray, values: np.ndarray, batch: np.ndarray, repeats: int) -> dict:
    import lmdb

    env = lmdb.open(str(root / "lmdb"), map_size=4 * keys.size * (8 + 4 * WIDTH) + (1 << 26), sync=False)
    try:
        started = time.perf_counter()
        with env.begin(write=True) as txn:
            txn.cursor().putmulti(_pairs(keys, values))
        load = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(repeats):
            with env.begin() as txn:
                kb = batch.tobytes()
                found = txn.cursor().getmulti([kb[8 * i:8 * i + 8] for i in range(batch.size)])
                rows = np.frombuffer(b"".join(v for _, v in found), np.float32)
        get = time.perf_counter() - started
        assert np.array_equal(rows.reshape(-1, WIDTH), values[batch - 1])
        started = time.perf_counter()
        for _ in range(repeats):
            with env.begin(write=True) as txn:
                txn.cursor().putmulti(_pairs(batch, values[batch - 1]))
        put = time.perf_counter() - started
    finally:
        env.close()
    return {"load_us_per_row": _per_row(load, keys.size), "get_us_per_row": _per_row(get, repeats * batch.size),
            "put_us_per_row": _per_row(put, repeats * batch.size)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000, help="random keys read and written per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp", help="a directory on disk for the stores' files")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    keys = np.arange(1, args.rows + 1, dtype=np.uint64)
    values = rng.standard_normal((args.rows, WIDTH)).astype(np.float32)
    batch = rng.integers(1, args.rows + 1, args.batch).astype(np.uint64)
    results = {}
    for name, measure in (("disk tier", tier), ("rocksdb (rocksdict)", rocksdb), ("lmdb", lmdb_store)):
        root = Path(tempfile.mkdtemp(prefix="hybridrec-tier-stores-", dir=args.dir))
        try:
            results[name] = measure(root, keys, values, batch, args.repeats)
        except ImportError as exc:
            results[name] = {"not_measured": f"not installed: {exc}"}
        finally:
            shutil.rmtree(root, ignore_errors=True)
    tier_get = results["disk tier"]["get_us_per_row"]
    for name, row in results.items():
        if "get_us_per_row" in row:
            row["get_vs_tier"] = round(row["get_us_per_row"] / tier_get, 2)
    report = {"benchmark": "tier_stores", "rows": args.rows, "batch": args.batch, "repeats": args.repeats,
              "row_bytes": 4 * WIDTH, "results": results}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
