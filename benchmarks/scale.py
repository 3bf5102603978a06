"""Checkpoints of large embedding tables: what a dump costs a PS while it trains, and what a restore costs.

Run: python benchmarks/scale.py --rows 1000000 10000000 100000000 --out scale.json
     python benchmarks/scale.py --quick --out scale.json     (CI's form: one small table)

For each table size, one store (dim --dim, Adagrad, --stripes stripes, files under --shm-dir as a PS has them)
filled with that many rows, then, with a training thread looking up and updating batches of about --unique
distinct IDs (half Zipf, half uniform over the table) the whole time:

  * `outside`: the training thread's lookup and update latencies (at --steps-per-s) for --window seconds
    before the dump;
  * `full`: a full dump (services/embedding_ps/checkpoint.py) into --ckpt-dir while the thread trains:
    seconds, bytes, the process's private memory (RssAnon) above its level before the dump, the latencies
    during it (their max against `outside`'s: the longest a lookup or update waited for the dump);
  * `delta`: --delta-steps more training steps, then a delta dump (the thread stopped, so the changed rows
    are exactly known): rows, bytes, bytes per changed row against a row's bytes;
  * `ps_restart` (with --ps-restart): a real PS on the filled store, executed as `hybridrec serve` is (a
    container's restart: imports included) and forked as `hybridrec run` restarts one: seconds from its start
    to SERVING and to its first answered training lookup of 72,000 IDs, then the same after a SIGKILL (it
    re-attaches to the store's files);
  * `restore`: the source store is closed and removed (its rows of a sample of IDs kept), a new one loads the
    chain (full + delta): seconds, private memory above the level before, and the sample compared bit for bit.

`bound_bytes` is `checkpoint.dump_memory_bytes`, what `hybridrec plan` counts for a dump. --quick checks the
dump's measured extra memory against it (plus 16 MiB of slack for the interpreter and the training thread's
batches) and the sample's round trip, and exits 1 if either fails: a bound, not a time.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from subprocess import DEVNULL, Popen

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridrec.core.layouts import checkpoints  # noqa: E402
from hybridrec.core.runtime import rpc  # noqa: E402
from hybridrec.app.run.forkserver import ForkServer  # noqa: E402
from hybridrec.app.run.ports import free_port  # noqa: E402
from hybridrec.core.wire.frames import PSLookup  # noqa: E402
from hybridrec.core.config import Config, TierConfig  # noqa: E402
from hybridrec.core.runtime.rpc import is_serving  # noqa: E402
from hybridrec.core.wire.sharding import shard_of  # noqa: E402
from services.embedding_ps.checkpoint import (CHUNK_BYTES, dump_bytes, dump_memory_bytes,  # noqa: E402
                                              dump_shard, load_shard, row_bytes)
from services.embedding_ps.replica import open_stores_in  # noqa: E402
from services.embedding_ps.server import shard_dir  # noqa: E402
from services.embedding_ps import kernels as K  # noqa: E402
from services.embedding_ps.optimizers import accumulator_width  # noqa: E402
from services.embedding_ps.store import EmbeddingStore, StoreConfig, init_rows  # noqa: E402

SLACK_BYTES = 16 << 20
LOOKUP_IDS = 72_000
SAMPLE = 20_000


def private_bytes() -> int:
    """This process's anonymous resident memory (not its mapped store files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakMemory:
    """Samples `private_bytes` every 2 ms on a thread; `peak` above the level at `start`."""

    def __init__(self) -> None:
        self.base = self.high = private_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.high = max(self.high, private_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.high, private_bytes()) - self.base


class Trainer:
    """A thread that looks up and updates batches like a PS under training, recording each call's latency."""

    def __init__(self, store: EmbeddingStore, rows: int, unique: int, seed: int, steps_per_s: float) -> None:
        self.store, self.rows, self.unique = store, rows, unique
        self.period = 1.0 / steps_per_s if steps_per_s > 0 else 0.0
        self.rng = np.random.default_rng(seed)
        self.latencies: list[tuple[float, float]] = []  # (start, seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def batch(self) -> np.ndarray:
        half = self.unique // 2
        zipf = (self.rng.zipf(1.2, half) - 1) % self.rows + 1
        return np.unique(np.concatenate([zipf, self.rng.integers(1, self.rows + 1, half)]).astype(np.uint64))

    def step(self) -> None:
        ids = self.batch()
        grads = np.full((ids.size, self.store.config.dim), 0.01, np.float32)
        for call in (lambda: self.store.lookup(ids, train=True), lambda: self.store.update(ids, grads)):
            started = time.perf_counter()
            call()
            self.latencies.append((started, time.perf_counter() - started))

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = time.perf_counter()
        while not self._stop.is_set():
            self.step()
            due += self.period
            self._stop.wait(max(0.0, due - time.perf_counter()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, lo: float, hi: float) -> dict:
        """Latencies of calls that overlapped [lo, hi]."""
        calls = [(t, s) for t, s in self.latencies if t <= hi and t + s >= lo]
        if not calls:
            return {"calls": 0}
        seconds = np.array([s for _, s in calls])
        slowest = sorted(calls, key=lambda c: -c[1])[:3]
        return {"calls": int(seconds.size), "p50_ms": round(float(np.median(seconds)) * 1e3, 2),
                "p99_ms": round(float(np.quantile(seconds, 0.99)) * 1e3, 2),
                "max_ms": round(float(seconds.max()) * 1e3, 2),
                "slowest": [{"at_s": round(t - lo, 3), "ms": round(s * 1e3, 2)} for t, s in slowest]}


def fill(store: EmbeddingStore, rows: int, batch: int = 1 << 20) -> float:
    started = time.perf_counter()
    for lo in range(1, rows + 1, batch):
        store.lookup(np.arange(lo, min(lo + batch, rows + 1), dtype=np.uint64), train=True)
    return time.perf_counter() - started


def job_config(rows: int, dim: int, stripes: int, shm: Path, address: str, storage: str = "fp32",
               optimizer: str = "adagrad") -> Config:
    """A one-shard job whose PS store of width `dim` holds `rows` rows: the store this benchmark fills is the
    one `hybridrec serve embedding_ps` opens with it."""
    capacity = int(rows * 1.02) + 64 * stripes  # stripes are not even: room for every row in each
    return Config.model_validate({
        "data": {"train": ["unused.tsv"]},
        "features": [{"name": "C1", "group": 0, "dim": dim}, {"name": "C2", "group": 0, "dim": dim}],
        "optimizer": {"embedding": {"name": optimizer, "lr": 0.05}},
        # a PS refuses a lookup of more IDs than a batch holds: two features of a batch of half of them
        "training": {"seed": 1, "batch_size": LOOKUP_IDS // 2},
        "ps": {"capacity": capacity, "num_stripes": stripes, "shm_dir": str(shm), "storage": storage},
        "cluster": {"ps": [address], "bind_host": "127.0.0.1"}})


def store_config(rows: int, dim: int, stripes: int, storage: str = "fp32", optimizer: str = "adagrad") -> StoreConfig:
    return StoreConfig.from_config(job_config(rows, dim, stripes, Path("/unused"), "127.0.0.1:1", storage,
                                              optimizer), dim)


def serving_after(start, address: str, ids: dict[int, np.ndarray], log: Path,
                  timeout_s: float = 300.0) -> tuple[dict, object]:
    """`start()` a PS and poll its health every 10 ms: ({seconds until it answers SERVING, until it has answered
    a training lookup of --unique IDs}, the process)."""
    started = time.perf_counter()
    proc = start()
    while not asyncio.run(is_serving(address, timeout_s=0.5)):
        if proc.poll() is not None or time.perf_counter() - started > timeout_s:
            proc.kill()
            raise RuntimeError(f"the PS did not serve (exit {proc.poll()}); see {log}")
        time.sleep(0.01)
    serving = time.perf_counter() - started

    async def lookup() -> None:
        async with rpc.channel(address) as channel:
            await rpc.raw_method(channel, "EmbeddingPS", "Lookup")(PSLookup(ids, train=True).encode(),
                                                                   timeout=60)

    asyncio.run(lookup())
    return {"serving_s": round(serving, 2), "first_lookup_s": round(time.perf_counter() - started, 2)}, proc


def ps_restart(config: Config, work: Path, dim: int, rows: int) -> dict:
    """A real PS on the filled store, started as `hybridrec serve` is (imports and all: a container's restart)
    and forked as `hybridrec run` restarts one (hybridrec/app/run/forkserver.py): each started, killed with
    SIGKILL and started again."""
    path = work / "ps.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    argv = ["serve", "embedding_ps", "--config", str(path), "--replica", "0"]
    address, log = config.cluster.ps[0], work / "ps.log"
    ids = {dim: np.unique(np.random.default_rng(3).integers(1, rows + 1, LOOKUP_IDS)).astype(np.uint64)}
    parent = ForkServer(work / "forkserver.log")
    parent.start()
    parent.configure(path)
    parent.wait_ready()
    starts = {"serve": lambda: Popen([sys.executable, "-m", "hybridrec", *argv], stdout=DEVNULL,
                                     stderr=log.open("ab")),
              "forked": lambda: parent.spawn(argv, log)}
    out = {}
    try:
        for how, start in starts.items():
            first, proc = serving_after(start, address, ids, log)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            again, proc = serving_after(start, address, ids, log)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            out[how] = {"start": first, "after_sigkill": again}
    finally:
        parent.close()
    return out


def measure(rows: int, args, shm: Path, ckpt: Path) -> dict:
    job = job_config(rows, args.dim, args.stripes, shm / f"rows{rows}", f"127.0.0.1:{free_port()}", args.storage,
                     args.optimizer)
    config = StoreConfig.from_config(job, args.dim)
    (store,) = open_stores_in(shard_dir(job, 0), job).values()  # where the PS finds it
    out: dict = {"rows": rows, "dim": args.dim, "stripes": args.stripes, "capacity": config.capacity,
                 "storage": args.storage, "optimizer": args.optimizer,
                 "row_bytes": row_bytes(store.config), "store_shm_bytes": store.shm_bytes,
                 "chunk_bytes": args.chunk_bytes,
                 "bound_bytes": dump_memory_bytes(store.config, args.chunk_bytes)}
    out["fill_s"] = round(fill(store, rows), 2)
    trainer = Trainer(store, rows, args.unique, seed=rows, steps_per_s=args.steps_per_s)
    trainer.start()
    time.sleep(args.window)  # warming up: the private arrays' first pages, the caches
    warm = time.perf_counter()
    time.sleep(args.window)
    started = time.perf_counter()
    memory = PeakMemory()
    full = dump_shard({args.dim: store}, checkpoints.step_dir(ckpt, 1), shard=0, num_shards=1, step=1,
                      chunk_bytes=args.chunk_bytes)
    ended = time.perf_counter()
    extra = memory.stop()
    trainer.stop()
    out["full"] = {"seconds": round(ended - started, 2), "rows": full["tables"][str(args.dim)]["num_rows"],
                   "bytes": dump_bytes(full), "extra_private_bytes": extra,
                   "during": trainer.between(started, ended),
                   "longest_lock_hold_ms": round(store.longest_hold_s * 1e3, 2), "copies": dict(store.dump_copies)}
    out["outside"] = trainer.between(warm, started)
    for _ in range(args.delta_steps):
        trainer.step()
    changed = store.changed_rows()
    started = time.perf_counter()
    delta = dump_shard({args.dim: store}, checkpoints.step_dir(ckpt, 2), shard=0, num_shards=1, step=2, base=1,
                       full_every=8, chunk_bytes=args.chunk_bytes)
    out["delta"] = {"seconds": round(time.perf_counter() - started, 2), "steps": args.delta_steps,
                    "changed_rows": changed, "rows": delta["tables"][str(args.dim)]["num_rows"],
                    "chain": delta["chain"], "bytes": dump_bytes(delta),
                    "bytes_per_changed_row_bytes": round(
                        dump_bytes(delta) / max(1, changed * row_bytes(store.config)), 4)}
    sample = np.random.default_rng(7).integers(1, rows + 1, SAMPLE).astype(np.uint64)
    expected, found = store.peek(sample, state=True)
    live = store.num_rows
    store.close()
    if args.ps_restart:
        out["ps_restart"] = ps_restart(job, ckpt.parent, args.dim, rows)
    shutil.rmtree(shm / f"rows{rows}")
    restored = EmbeddingStore.open(shm / f"restored{rows}", config)
    started = time.perf_counter()
    memory = PeakMemory()
    load_shard(checkpoints.step_dir(ckpt, 2), {args.dim: restored}, shard=0, num_shards=1,
               shard_of=lambda ids: shard_of(ids, 1))
    got, got_found = restored.peek(sample, state=True)
    out["restore"] = {"seconds": round(time.perf_counter() - started, 2), "extra_private_bytes": memory.stop(),
                      "rows": restored.num_rows, "rows_before": live,
                      "sample_bit_for_bit": bool(np.array_equal(found, got_found)
                                                 and expected.tobytes() == got.tobytes())}
    restored.close()
    shutil.rmtree(shm / f"restored{rows}")
    shutil.rmtree(ckpt)
    ckpt.mkdir()
    return out


# ---------------------------------------------------------------- the disk tier (ps.tier)
class ZipfBatches:
    """Batches of `unique` distinct IDs in [1, rows], Zipf-ranked (ID = rank; ranks past the table wrap over it),
    each drawn afresh: a table is touched all over, as training touches it."""

    def __init__(self, rows: int, unique: int, exponent: float, seed: int) -> None:
        self.rows, self.unique, self.exponent = rows, unique, exponent
        self.rng = np.random.default_rng(seed)
        self.draws = unique

    def __next__(self) -> np.ndarray:
        while True:
            ids = np.unique((self.rng.zipf(self.exponent, self.draws) - 1) % self.rows + 1).astype(np.uint64)
            if ids.size >= self.unique:
                return self.rng.permutation(ids)[:self.unique]
            self.draws = int(self.draws * 1.2 * self.unique / max(ids.size, 1)) + 1


def generated_rows(store: EmbeddingStore, ids: np.ndarray) -> np.ndarray:
    """Rows (embedding and optimizer state) as the store would create them for `ids`: the initial embedding,
    the optimizer's accumulators at their initial value and the rest of its state at zero."""
    c = store.config
    values = np.zeros((ids.size, c.row_width), np.float32)
    values[:, :c.dim] = init_rows(ids, dim=c.dim, seed=c.seed, distribution=c.ps.init.distribution,
                                  scale=c.ps.init.scale)
    values[:, c.dim:c.dim + accumulator_width(c.optimizer, c.dim)] = c.optimizer.initial_accumulator_value
    return values


def prefill(store: EmbeddingStore, hot: int, rows: int, chunk: int = 1 << 22) -> dict:
    """IDs 1..hot into memory (`load_rows`), hot+1..rows onto the disk tier in file order (`load_cold`): a
    table of `rows` rows as if trained, the most used in memory. Returns its seconds per part."""
    started = time.perf_counter()
    for lo in range(1, hot + 1, chunk):
        ids = np.arange(lo, min(lo + chunk, hot + 1), dtype=np.uint64)
        store.load_rows(ids, generated_rows(store, ids))
    in_memory = time.perf_counter() - started
    if rows > hot:
        cold = np.arange(hot + 1, rows + 1, dtype=np.uint64)
        pages = np.empty(cold.size, np.int64)
        K.tier_home_pages(cold, store.config.num_stripes, store.tier.layout.pages_per_stripe, pages)
        order = np.argsort(pages, kind="stable")
        del pages
        for lo in range(0, cold.size, chunk):
            ids = cold[order[lo:lo + chunk]]
            store.load_cold(ids, generated_rows(store, ids))
        del order, cold
    store.flush()
    return {"memory_s": round(in_memory, 1), "disk_s": round(time.perf_counter() - started - in_memory, 1)}


def train_flat_out(store: EmbeddingStore, batches: ZipfBatches, seconds: float) -> dict:
    """Look up and update fresh batches until the calls took `seconds`: steps per second of the store's calls
    (drawing a batch is not timed), and what the process read from disk meanwhile."""
    grads = np.full((batches.unique, store.config.dim), 0.01, np.float32)
    io = Path("/proc/self/io")
    read0 = int(io.read_text().split("read_bytes: ")[1].split()[0])
    steps, busy = 0, 0.0
    while busy < seconds:
        ids = next(batches)
        started = time.perf_counter()
        store.lookup(ids, train=True)
        store.update(ids, grads)
        busy += time.perf_counter() - started
        steps += 1
    read = int(io.read_text().split("read_bytes: ")[1].split()[0]) - read0
    return {"steps": steps, "seconds": round(busy, 2), "steps_per_s": round(steps / busy, 3),
            "disk_read_mb_per_s": round(read / busy / 1e6, 1)}


def tier_store_config(rows: int, memory: int, dim: int, stripes: int, disk: Path) -> StoreConfig:
    base = store_config(memory, dim, stripes)
    return dataclasses.replace(base, ps=base.ps.model_copy(update={"tier": TierConfig(dir=str(disk),
                                                                                       capacity=int(rows * 1.02))}))


def measure_tier(args, shm: Path, disk: Path) -> dict:
    """A table of --tier-rows rows, --memory-share of it in memory over a disk tier, trained flat out with
    Zipf batches of --unique distinct IDs; against a table of --baseline-rows that fits in memory, trained
    with the same distinct IDs per batch. Each: prefilled, --warm-up seconds trained, then --window measured."""
    dim, stripes = args.dim, args.stripes
    memory = int(args.tier_rows * args.memory_share)
    out = {"rows": args.tier_rows, "memory_rows": memory, "baseline_rows": args.baseline_rows, "zipf": args.zipf,
           "unique_ids_per_batch": args.unique}
    with EmbeddingStore.open(shm / "baseline", store_config(args.baseline_rows, dim, stripes)) as base:
        out["baseline_prefill_s"] = prefill(base, args.baseline_rows, args.baseline_rows)["memory_s"]
        batches = ZipfBatches(args.baseline_rows, args.unique, args.zipf, seed=1)
        train_flat_out(base, batches, args.warm_up)
        out["baseline"] = train_flat_out(base, batches, args.window)
        out["baseline"]["shm_bytes"] = base.shm_bytes
    shutil.rmtree(shm / "baseline")
    config = tier_store_config(args.tier_rows, memory, dim, stripes, disk)
    with EmbeddingStore.open(shm / "shard-00000" / f"dim-{dim}", config) as store:
        out["prefill"] = prefill(store, memory, args.tier_rows)
        out["prefill"]["disk_rows"] = store.tier.num_rows
        batches = ZipfBatches(args.tier_rows, args.unique, args.zipf, seed=1)
        out["cold_share_of_ids"] = round(float(np.mean([np.mean(next(batches) > memory) for _ in range(8)])), 4)
        warm = train_flat_out(store, batches, args.warm_up)
        before = store.tier.stats()
        out["tiered"] = train_flat_out(store, batches, args.window)
        after = store.tier.stats()
        out["tiered"] |= {k: after[k] - before[k] for k in ("fills", "writebacks", "overflows", "disk_updates",
                                                              "lookups", "misses")}
        out["tiered"]["memory_hit_rate"] = round(1 - out["tiered"]["misses"] / max(1, out["tiered"]["lookups"]), 4)
        out["tiered"] |= {"warm_up_steps_per_s": warm["steps_per_s"], "shm_bytes": store.shm_bytes,
                          "disk_file_bytes": store.tier.layout.nbytes, "disk_rows": after["rows"],
                          "disk_row_bytes": after["bytes"], "dropped_gradients": store.stats()["missing_updates"]}
        out["table_bytes"] = args.tier_rows * 4 * config.row_width
    out["ratio"] = round(out["tiered"]["steps_per_s"] / out["baseline"]["steps_per_s"], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000, 100_000_000])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--stripes", type=int, default=16)
    parser.add_argument("--storage", default="fp32", choices=["fp32", "fp16", "bf16"], help="ps.storage of the store")
    parser.add_argument("--optimizer", default="adagrad", help="the embedding optimizer (rowwise_adagrad: one "
                        "accumulator a row)")
    parser.add_argument("--unique", type=int, default=72_000, help="distinct IDs per training batch")
    parser.add_argument("--steps-per-s", type=float, default=10.0,
                        help="the training thread's pace (10: about 40k samples/s of 4096-sample batches; 0: flat out)")
    parser.add_argument("--window", type=float, default=3.0, help="seconds of training measured before a dump")
    parser.add_argument("--delta-steps", type=int, default=20)
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="a dump's chunk (checkpoint.CHUNK_BYTES)")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--ckpt-dir", default=None, help="where dumps go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="CI's form: 400k rows, short windows, checked")
    parser.add_argument("--ps-restart", action="store_true",
                        help="also time a real PS on the filled store: its start, and its restart after SIGKILL")
    parser.add_argument("--out", default=None)
    tier = parser.add_argument_group("the disk tier (--tier-rows: this case alone)")
    tier.add_argument("--tier-rows", type=int, default=None, help="rows of the table over a disk tier")
    tier.add_argument("--memory-share", type=float, default=0.25, help="share of them in memory (ps.capacity)")
    tier.add_argument("--baseline-rows", type=int, default=40_000_000, help="rows of the in-memory table")
    tier.add_argument("--tier-dir", default="/var/tmp", help="a directory on disk for the tier")
    tier.add_argument("--zipf", type=float, default=1.1, help="exponent of the batches' ID ranks")
    tier.add_argument("--warm-up", type=float, default=20.0, help="seconds trained before the window")
    args = parser.parse_args()
    if args.tier_rows is not None:
        return tier_main(args)
    if args.quick:
        args.rows, args.window, args.delta_steps, args.unique = [400_000], 1.0, 5, 5_000
        args.chunk_bytes = 8 << 20
    shm = Path(tempfile.mkdtemp(prefix="hybridrec-scale-", dir=args.shm_dir))
    ckpt = Path(tempfile.mkdtemp(prefix="hybridrec-scale-", dir=args.ckpt_dir))
    try:
        with EmbeddingStore.open(shm / "warm", store_config(1000, args.dim, 2, args.storage,
                                                            args.optimizer)) as warm:
            train = Trainer(warm, 1000, 100, seed=0, steps_per_s=0)
            train.step()  # the kernels compiled before anything is measured: a step, a dump, a restore
            dump_shard({args.dim: warm}, ckpt / "warm", shard=0, num_shards=1, step=0)
            load_shard(ckpt / "warm", {args.dim: warm}, shard=0, num_shards=1, shard_of=lambda ids: shard_of(ids, 1))
        shutil.rmtree(ckpt / "warm")
        results = [measure(rows, args, shm, ckpt) for rows in args.rows]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
    checks = [{"rows": r["rows"],
               "dump_within_bound": r["full"]["extra_private_bytes"] <= r["bound_bytes"] + SLACK_BYTES,
               "restore_bit_for_bit": r["restore"]["sample_bit_for_bit"],
               "delta_within_1_1x": r["delta"]["bytes_per_changed_row_bytes"] <= 1.1 or r["delta"]["chain"] == [2]}
              for r in results]  # a dump after over half the rows changed is full by design: no delta to check
    report = {"benchmark": "scale", "quick": args.quick, "slack_bytes": SLACK_BYTES, "results": results,
              "checks": checks}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    ok = all(c["dump_within_bound"] and c["restore_bit_for_bit"] and c["delta_within_1_1x"] for c in checks)
    return 0 if ok or not args.quick else 1


def tier_main(args) -> int:
    if args.quick:
        args.tier_rows, args.baseline_rows, args.unique = 400_000, 100_000, 5_000
        args.window, args.warm_up = 2.0, 1.0
    shm = Path(tempfile.mkdtemp(prefix="hybridrec-scale-", dir=args.shm_dir))
    disk = Path(tempfile.mkdtemp(prefix="hybridrec-scale-tier-", dir=args.tier_dir))
    try:
        with EmbeddingStore.open(shm / "warm" / "dim", tier_store_config(2000, 500, args.dim, 2, disk / "warm")) as w:
            prefill(w, 500, 2000)  # the kernels compiled before anything is measured
            train_flat_out(w, ZipfBatches(2000, 100, args.zipf, seed=0), 0.1)
        shutil.rmtree(disk / "warm")
        result = measure_tier(args, shm, disk)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    report = {"benchmark": "scale", "case": "disk tier", "quick": args.quick, "results": [result]}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    t = result["tiered"]
    return 0 if t["overflows"] == 0 and t["dropped_gradients"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
