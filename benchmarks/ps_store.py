"""Benchmark of the embedding PS store against plain numpy on the same rows.

Run: python benchmarks/ps_store.py --quick --out results.json

One table of --rows rows (default 4M) of width --dim (64) float32 with Adagrad
state, in a temporary directory under --shm-dir (deleted afterwards); the same
batches of Zipf-distributed IDs feed every measurement:
  * lookup rows/s of `store.lookup(train=True)` vs `numpy.take` on a plain
    (rows, dim) array holding the same rows;
  * Adagrad update rows/s vs a numpy reference (np.unique + fancy-index update);
  * two request threads vs one (total rows/s);
  * streaming 10x capacity distinct IDs (train lookups that insert and evict)
    vs inserting within capacity, and shm bytes before/after.
Each rate is the best of --repeats interleaved runs, by wall clock and by
thread CPU time: the machine is shared, and the best run is the one least
disturbed by other jobs (see "notes" in the output).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridrec.core.wire.sharding import splitmix64  # noqa: E402
from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig  # noqa: E402
from services.embedding_ps.store import EmbeddingStore, StoreConfig  # noqa: E402

LR, EPS, INIT_ACC = 0.01, 1e-10, 0.1


SPIN_ITERATIONS = 400_000_000


@njit(nogil=True)
def _spin(n: int) -> float:
    """CPU-bound loop without memory traffic or GIL: the thread-scaling control."""
    x = 0.0
    for i in range(n):
        x += (i % 7) * 0.5
    return x


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one fn() call."""
    w, c = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - c


def run_threads(threads: list[threading.Thread]) -> tuple[float, float]:
    """Start and join `threads`; (wall seconds, process CPU seconds per wall second)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return wall, (time.process_time() - c0) / wall


def race(fns: dict, rows: dict, repeats: int) -> dict:
    """Best rows/s of each fn by wall clock and by thread CPU time, runs interleaved.

    Interleaving makes the store and its numpy baseline share the same moments
    of the shared machine; CPU time excludes the time other jobs held the core
    (memory stalls still count), so it is the steadier of the two.
    """
    best = {name: [0.0, 0.0] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = timed(fn)
            best[name][0] = max(best[name][0], rows[name] / wall)
            best[name][1] = max(best[name][1], rows[name] / max(cpu, 1e-9))
    return {name: {"wall": w, "cpu": c} for name, (w, c) in best.items()}


def zipf_batches(rng, num_rows: int, *, exponent: float, batch: int, count: int) -> list[np.ndarray]:
    """Row positions of Zipf(exponent) draws over num_rows ranks; hot ranks land on random rows."""
    cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    where = rng.permutation(num_rows)
    return [where[np.minimum(np.searchsorted(cdf, rng.random(batch)), num_rows - 1)] for _ in range(count)]


def numpy_array_on_small_pages(array: np.ndarray) -> np.ndarray:
    """A copy of `array` that numpy does not madvise onto transparent huge pages (like the shm store)."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _set_madvise_hugepage
    previous = _set_madvise_hugepage(False)
    try:
        copy = np.empty_like(array)
    finally:
        _set_madvise_hugepage(previous)
    copy[...] = array
    return copy


def disk_bytes(directory: Path) -> int:
    """Bytes really allocated by the store's files (st_blocks), not just their sizes."""
    return sum(p.stat().st_blocks * 512 for p in directory.iterdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer batches and repeats (a few minutes)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--stream-factor", type=float, default=10.0, help="distinct IDs streamed, in capacities")
    ap.add_argument("--num-stripes", type=int, default=16)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    num_batches = 16 if args.quick else 64
    rng = np.random.default_rng(0)
    n, dim = args.rows, args.dim
    # 10% slack: stripes fill unevenly, and a full stripe would start evicting the benchmark's rows.
    config = StoreConfig(dim=dim, ps=PSConfig(capacity=int(n * 1.1), num_stripes=args.num_stripes),
                         optimizer=EmbeddingOptimizerConfig(name="adagrad", lr=LR, eps=EPS,
                                                            initial_accumulator_value=INIT_ACC))
    results: dict = {"config": {"rows": n, "capacity": config.capacity, "dim": dim, "batch": args.batch,
                                "zipf": args.zipf, "num_stripes": args.num_stripes, "repeats": repeats,
                                "batches": num_batches, "cpus": os.cpu_count()}}
    keys = splitmix64(np.arange(n, dtype=np.uint64))  # a bijection: distinct, scattered keys
    emb = rng.random((n, dim), dtype=np.float32) * np.float32(0.02) - np.float32(0.01)
    acc = np.full((n, dim), INIT_ACC, np.float32)
    rows = zipf_batches(rng, n, exponent=args.zipf, batch=args.batch, count=num_batches)
    ids = [keys[r] for r in rows]
    uniq_rows = [np.unique(r) for r in rows]
    uniq_ids = [keys[r] for r in uniq_rows]
    grads = [rng.standard_normal((len(r), dim), dtype=np.float32) * np.float32(0.01) for r in uniq_rows]
    total = sum(len(b) for b in ids)
    total_unique = sum(len(b) for b in uniq_ids)
    results["config"]["unique_fraction"] = total_unique / total
    load_start = os.getloadavg()
    emb_4k = numpy_array_on_small_pages(emb)
    work = Path(tempfile.mkdtemp(prefix="hybridrec-bench-", dir=args.shm_dir))
    try:
        store = EmbeddingStore.open(work / "table", config)
        for lo in range(0, n, 1 << 20):
            store.load_rows(keys[lo:lo + (1 << 20)], np.hstack([emb[lo:lo + (1 << 20)], acc[lo:lo + (1 << 20)]]))
        assert store.num_rows == n and store.stats()["evictions"] == 0
        out = np.empty((args.batch, dim), np.float32)
        store.lookup(ids[0], train=True, out=out)  # compile / warm up before timing
        store.update(uniq_ids[0][:10], np.zeros((10, dim), np.float32))  # zero grads: rows unchanged

        def np_lookup():
            for r in rows:
                np.take(emb, r, axis=0, out=out)

        def store_lookup(train=True):
            for b in ids:
                store.lookup(b, train=train, out=out)

        def np_lookup_4k():
            for r in rows:
                np.take(emb_4k, r, axis=0, out=out)

        r = results["rates_rows_per_s"] = race(
            {"numpy_take": np_lookup, "numpy_take_4k_pages": np_lookup_4k, "store_lookup_train": store_lookup,
             "store_lookup_readonly": lambda: store_lookup(False)}, dict.fromkeys(
                ["numpy_take", "numpy_take_4k_pages", "store_lookup_train", "store_lookup_readonly"], total), repeats)
        del emb_4k
        check = np.empty_like(out)
        store.lookup(ids[1], train=False, out=check)
        assert np.array_equal(check, emb[rows[1]]), "store rows differ from the numpy rows"

        def np_update():  # the reference a numpy PS would run: dedup, gather, update, scatter
            for rws, g in zip(uniq_rows, grads):
                u, first = np.unique(rws, return_index=True)
                g = g[first]
                w, s = emb[u], acc[u]
                s += g * g
                w -= np.float32(LR) * g / (np.sqrt(s) + np.float32(EPS))
                emb[u], acc[u] = w, s

        def np_update_no_unique():  # the same without the dedup (our IDs are already unique)
            for rws, g in zip(uniq_rows, grads):
                w, s = emb[rws], acc[rws]
                s += g * g
                w -= np.float32(LR) * g / (np.sqrt(s) + np.float32(EPS))
                emb[rws], acc[rws] = w, s

        def store_update():
            for b, g in zip(uniq_ids, grads):
                store.update(b, g)

        r.update(race({"numpy_adagrad_update": np_update, "numpy_adagrad_update_no_unique": np_update_no_unique,
                       "store_adagrad_update": store_update},
                      dict.fromkeys(["numpy_adagrad_update", "numpy_adagrad_update_no_unique",
                                     "store_adagrad_update"], total_unique), repeats))

        def threaded(num_threads: int, mixed: bool) -> tuple[float, float]:
            """(total rows/s, process CPU seconds per wall second) of num_threads threads sharing the batches."""
            outs = [np.empty_like(out) for _ in range(num_threads)]

            def worker(t: int) -> None:
                for k in range(t, num_batches, num_threads):
                    store.lookup(ids[k], train=True, out=outs[t])
                    if mixed:
                        store.update(uniq_ids[k], grads[k])

            wall, busy = run_threads([threading.Thread(target=worker, args=(t,)) for t in range(num_threads)])
            return total / wall, busy

        def control(num_threads: int) -> tuple[float, float]:
            """The same measurement for a trivial nogil numba loop: how much parallelism the machine gives now."""
            wall, busy = run_threads([threading.Thread(target=_spin, args=(SPIN_ITERATIONS // num_threads,))
                                      for _ in range(num_threads)])
            return SPIN_ITERATIONS / wall, busy

        _spin(10)
        for name, fn in (("lookup", lambda k: threaded(k, False)), ("lookup_update", lambda k: threaded(k, True)),
                         ("control_spin", control)):
            best = {1: (0.0, 0.0), 2: (0.0, 0.0)}
            for _ in range(repeats):  # interleaved, best of each
                for num_threads in (1, 2):
                    best[num_threads] = max(best[num_threads], fn(num_threads))
            for num_threads, (rate, busy) in best.items():
                r[f"threads{num_threads}_{name}"] = {"wall": rate, "cpus_busy": busy}
        store.check_consistency()
        results["shm_overhead"] = store.shm_bytes / (config.capacity * config.row_width * 4)
        results["shm_overhead_per_live_row"] = store.shm_bytes / (n * config.row_width * 4)
        store.close()
        shutil.rmtree(work / "table")
        del emb, acc

        # Streaming: a fresh table of the same shape fed only distinct IDs.
        store = EmbeddingStore.open(work / "stream", config)
        shm_before = disk_bytes(work / "stream")

        def stream(first: int, count: int) -> dict:
            """rows/s of train lookups of `count` distinct IDs (generated before timing), whole run."""
            fresh = splitmix64(np.arange(first, first + count, dtype=np.uint64))
            wall = cpu = 0.0
            for k in range(0, count, args.batch):
                w, c = timed(lambda: store.lookup(fresh[k:k + args.batch], train=True, out=out))
                wall, cpu = wall + w, cpu + c
            return {"wall": count / wall, "cpu": count / cpu}

        in_cap = n // args.batch * args.batch  # fill up to `rows` (capacity has 10% slack): no eviction
        r["stream_within_capacity"] = stream(1 << 41, in_cap)
        evict_before = store.stats()["evictions"]
        streamed = int(args.stream_factor * config.capacity) // args.batch * args.batch
        r["stream_evicting"] = stream(1 << 42, streamed)
        st = store.stats()
        results["streaming"] = {"distinct_ids": in_cap + streamed, "evictions": st["evictions"] - evict_before,
                                "rows_after": st["rows"], "shm_bytes_before": shm_before,
                                "shm_bytes_after": disk_bytes(work / "stream"), "store_shm_bytes": st["shm_bytes"]}
        store.check_consistency()
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ratio(a: str, b: str, clock: str = "wall") -> float:
        return r[a][clock] / r[b][clock]

    for suffix, clock in (("", "wall"), ("_cpu", "cpu")):
        results["lookup_ratio_vs_numpy" + suffix] = ratio("store_lookup_train", "numpy_take", clock)
        results["lookup_readonly_ratio_vs_numpy" + suffix] = ratio("store_lookup_readonly", "numpy_take", clock)
        results["lookup_ratio_vs_numpy_4k_pages" + suffix] = ratio("store_lookup_train", "numpy_take_4k_pages", clock)
        results["update_ratio_vs_numpy" + suffix] = ratio("store_adagrad_update", "numpy_adagrad_update", clock)
        results["update_ratio_vs_numpy_no_unique" + suffix] = ratio(
            "store_adagrad_update", "numpy_adagrad_update_no_unique", clock)
        results["streaming_ratio" + suffix] = ratio("stream_evicting", "stream_within_capacity", clock)
    results["thread_scaling"] = ratio("threads2_lookup", "threads1_lookup")
    results["thread_scaling_lookup_update"] = ratio("threads2_lookup_update", "threads1_lookup_update")
    results["thread_scaling_control_spin"] = ratio("threads2_control_spin", "threads1_control_spin")
    results["load_average"] = {"start": load_start, "end": os.getloadavg()}
    results["notes"] = (
        "Rates are the best of `repeats` interleaved runs. 'wall' is what a caller sees; 'cpu' divides by the "
        "thread's CPU time, which excludes time other jobs held the core (this machine is shared: see "
        "load_average), so *_cpu ratios are the steadier estimate of an idle machine. thread_scaling needs a "
        "second idle core: cpus_busy shows how much CPU the process actually got, and "
        "thread_scaling_control_spin is the scaling of a trivial GIL-free loop measured alongside (with "
        "sched_autogroup, a busy machine gives one process the same CPU share however many threads it runs). "
        "numpy arrays are on transparent huge pages; the store's /dev/shm mapping is on 4 KiB pages (tmpfs huge=never here), "
        "hence the extra numpy_take_4k_pages baseline.")
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
