"""Prepared-data benchmark: what `hybridrec data prepare` costs and what it saves the data loader. Writes JSON.

For one Criteo TSV file (default: the README's data/synth/train.tsv), in one run:

1. `prepare`: wall seconds, and the sizes of the source and of the prepared directory (written under --work,
   default a temporary directory under /tmp, removed at the end);
2. reading: the data loader's `train_batches` over the whole file, raw TSV vs prepared, in seconds (wall and
   process CPU) per 1M rows: `read` iterates the batches only; `frames` also builds what is sent per batch
   (`Rows.sparse` with its per-feature dedup and both frames encoded), the loader's whole per-batch work;
   `major_faults` counts page faults that had to read the disk (prepared pages the kernel had evicted).

The prepared pass runs after `prepare` wrote the files, so they are in the page cache, as they are from the
second epoch on; the TSV is read from the page cache too (it was just read by `prepare`).

    python benchmarks/prepared.py --out results/prepared.json
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrec.core.config import from_dict  # noqa: E402
from hybridrec.core.wire.frames import DenseBatch  # noqa: E402
from services.dataloader.batching import ReadCounters  # noqa: E402
from services.dataloader.prepared_write import prepare  # noqa: E402
from services.dataloader.sources import train_batches  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README_TRAIN = REPO / "data" / "synth" / "train.tsv"


def _pass(config, frames: bool) -> dict:
    """One pass over the training stream: rows, wall and CPU seconds, page faults that read from disk."""
    counters = ReadCounters()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    wall, cpu = time.perf_counter(), time.process_time()
    for rows, _ in train_batches(config, counters):
        if frames:
            rows.sparse("train").encode(lz4=config.training.compression.lz4_ids)
            DenseBatch(1, rows.dense, rows.labels).encode()
    return {"rows": counters.rows, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults}


def _per_million(result: dict) -> dict:
    scale = 1e6 / max(result["rows"], 1)
    return {"rows": result["rows"], "wall_s_per_1m": round(result["wall_s"] * scale, 3),
            "cpu_s_per_1m": round(result["cpu_s"] * scale, 3), "major_faults": result["major_faults"]}


def bench(src: Path, work: Path, batch_size: int) -> dict:
    """Prepare `src` under `work`, then read it both ways; the results as a JSON-able dict."""
    tsv = from_dict({"data": {"train": [str(src)]}, "training": {"batch_size": batch_size}})
    out = work / "prepared"
    started = time.perf_counter()
    manifest = prepare([src], out, tsv, force=True)
    prepare_s = time.perf_counter() - started
    prepared = from_dict({"data": {"train": [str(out)]}, "training": {"batch_size": batch_size}})
    result = {"source": str(src), "rows": manifest.rows, "batch_size": batch_size,
              "prepare": {"wall_s": round(prepare_s, 2), "source_bytes": src.stat().st_size,
                          "prepared_bytes": sum(f.bytes for s in manifest.shards for f in s.files.values())}}
    for what, frames in (("read", False), ("frames", True)):
        raw, prep = _per_million(_pass(tsv, frames)), _per_million(_pass(prepared, frames))
        result[what] = {"tsv": raw, "prepared": prep,
                        "speedup_wall": round(raw["wall_s_per_1m"] / max(prep["wall_s_per_1m"], 1e-9), 1)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=README_TRAIN, help="Criteo TSV file (default data/synth/train.tsv)")
    ap.add_argument("--work", type=Path, default=None, help="where the prepared copy goes (default: a temp dir)")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    if not args.src.is_file():
        sys.exit(f"{args.src}: no such file (make it: hybridrec data synth --out data/synth --rows 1000000)")
    work = Path(tempfile.mkdtemp(prefix="hybridrec-prepared-")) if args.work is None else args.work
    try:
        result = bench(args.src, work, args.batch_size)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
