"""The PS store's lookups and updates per layout: float32 Adagrad rows against 16-bit rows with row-wise Adagrad.

One store per layout (width --dim, 16 stripes, under /dev/shm), filled with --rows rows, then batches of about
--batch distinct IDs drawn uniformly over the table (a large table's rows lie at random: every row a cache
miss) looked up for training and updated, --repeats times over the same batches. Rows per second of each call
(best, and median); layouts measured one after the other in one run, so compare them within a run.

    python benchmarks/compact_kernels.py --rows 10000000 --out compact_kernels.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scale import store_config  # noqa: E402
from services.embedding_ps.store import EmbeddingStore  # noqa: E402

LAYOUTS = ["fp32:adagrad", "fp16:rowwise_adagrad", "bf16:rowwise_adagrad"]


def measure(storage: str, optimizer: str, rows: int, dim: int, batches: list[np.ndarray], repeats: int) -> dict:
    shm = Path(tempfile.mkdtemp(prefix="compact-kernels-", dir="/dev/shm"))
    try:
        with EmbeddingStore.open(shm / "store", store_config(rows, dim, 16, storage, optimizer)) as store:
            for lo in range(1, rows + 1, 1 << 20):
                store.lookup(np.arange(lo, min(lo + (1 << 20), rows + 1), dtype=np.uint64), train=True)
            lookups, updates = [], []
            for _ in range(repeats):
                for ids in batches:
                    grads = np.full((ids.size, dim), 0.01, np.float32)
                    started = time.perf_counter()
                    store.lookup(ids, train=True)
                    lookups.append(ids.size / (time.perf_counter() - started))
                    started = time.perf_counter()
                    store.update(ids, grads)
                    updates.append(ids.size / (time.perf_counter() - started))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {f"{name}_mrows_per_s": {"best": round(max(rates) / 1e6, 2), "median": round(float(np.median(rates)) / 1e6, 2)}
            for name, rates in (("lookup", lookups), ("update", updates))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=62_000, help="IDs drawn a batch (distinct ones kept)")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", action="append", default=None, help="STORAGE:OPTIMIZER (default: all three)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [np.unique(rng.integers(1, args.rows + 1, args.batch).astype(np.uint64)) for _ in range(args.batches)]
    results = {}
    for layout in args.layout or LAYOUTS:
        storage, optimizer = layout.split(":")
        results[layout] = measure(storage, optimizer, args.rows, args.dim, batches, args.repeats)
        print(layout, results[layout], flush=True)
    base = results.get("fp32:adagrad")
    if base:
        for layout, r in results.items():
            r["vs_fp32_adagrad"] = {k: round(r[k]["best"] / base[k]["best"], 3)
                                    for k in ("lookup_mrows_per_s", "update_mrows_per_s")}
    report = {"benchmark": "compact_kernels", "rows": args.rows, "dim": args.dim,
              "distinct_ids_per_batch": int(np.mean([b.size for b in batches])), "layouts": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v.get("vs_fp32_adagrad") for k, v in results.items()}))


if __name__ == "__main__":
    main()
