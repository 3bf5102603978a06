"""A large table trained to the end, against the same job on a small one: samples/s, AUC, and what each interval
checkpoint added to a PS's private memory.

Each case is `hybridrec run examples/criteo_synth.yaml` on one `hybridrec data synth` directory, with its own
`ps.capacity` and the --set given to every case (the layout: `ps.storage`, the optimizer). Cases run one after
the other in one invocation, so the ratio of samples/s is between runs on the same machine in the same hour.
While a case runs, a thread samples every PS process's anonymous resident memory (RssAnon: not its mapped store
files) every 50 ms; afterwards each PS checkpoint the PS logs wrote ("ps shard checkpoint written": its end
and its seconds) is matched with the samples: its peak during the checkpoint above the median of the two
seconds before it (`added_private_bytes`).

    python benchmarks/large_table.py --case 250m:data250m:130000000 --case 10m:data10m:5100000 \\
        --set ps.storage=fp16 --set optimizer.embedding.name=rowwise_adagrad --work /var/tmp --out large.json

--work holds the run directories and their checkpoints: on a disk for large tables (their checkpoints do not
fit in memory beside the store).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SAMPLE_S = 0.05
BEFORE_S = 2.0


class PSMemory:
    """Samples RssAnon of every process whose command line is `hybridrec serve embedding_ps ... --replica N` (a PS
    forked by `hybridrec run` sets its title to that: one string, words separated by spaces, not NULs)."""

    def __init__(self) -> None:
        self.samples: dict[int, list[tuple[float, int]]] = {}  # replica -> (unix time, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PSMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").split()  # a retitled process: spaces
                    if b"embedding_ps" not in argv or b"--replica" not in argv:
                        continue
                    replica = int(argv[argv.index(b"--replica") + 1])
                    status = (proc / "status").read_text()
                except (OSError, ValueError, IndexError):
                    continue  # the process ended between the listing and the read
                anon = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:"))
                self.samples.setdefault(replica, []).append((time.time(), anon))

    def added_during(self, replica: int, start: float, end: float) -> dict:
        """Peak private bytes in [start, end] above the median of the BEFORE_S seconds before `start`."""
        series = np.array(self.samples.get(replica, []), dtype=np.float64).reshape(-1, 2)
        before = series[(series[:, 0] >= start - BEFORE_S) & (series[:, 0] < start), 1]
        during = series[(series[:, 0] >= start) & (series[:, 0] <= end), 1]
        if before.size == 0 or during.size == 0:
            return {"samples": int(during.size)}
        base = float(np.median(before))
        return {"samples": int(during.size), "before_bytes": int(base), "peak_bytes": int(during.max()),
                "added_private_bytes": int(during.max() - base)}


def checkpoints_logged(logs: Path) -> list[dict]:
    """Every "ps shard checkpoint written" event of the PS logs, with its replica and [start, end] in unix time."""
    events = []
    for log in sorted(logs.glob("embedding_ps-*.log")):
        replica = int(log.stem.rsplit("-", 1)[1])
        for line in log.read_text().splitlines():
            if '"ps shard checkpoint written"' not in line:
                continue
            event = json.loads(line)
            end = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
            events.append({"replica": replica, "step": event["step"], "delta": event["delta"],
                           "seconds": event["seconds"], "rows": event["rows"], "bytes": event["bytes"],
                           "start": end - event["seconds"], "end": end})
    return events


def run_case(name: str, data: Path, capacity: int, work: Path, shm: Path, extra: list[str]) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    summary = out / "summary.json"
    argv = [sys.executable, "-m", "hybridrec", "run", str(REPO / "examples" / "criteo_synth.yaml"),
            "--run-dir", str(out / "run"), "--summary-json", str(summary),
            "--set", f"data.train=[{data / 'train.tsv'}]", "--set", f"data.eval=[{data / 'eval.tsv'}]",
            "--set", f"data.oracle={data / 'oracle.json'}", "--set", f"ps.capacity={capacity}",
            "--set", f"ps.shm_dir={shm / name}", *extra]
    with PSMemory() as memory:
        subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    result = json.loads(summary.read_text())
    ckpts = []
    for event in checkpoints_logged(out / "run" / "logs"):
        ckpts.append({k: v for k, v in event.items() if k not in ("start", "end")}
                     | memory.added_during(event["replica"], event["start"], event["end"]))
    added = [c["added_private_bytes"] for c in ckpts if "added_private_bytes" in c]
    keep = ("samples", "samples_per_sec", "train_wall_s", "auc", "oracle_auc", "logloss", "skipped_batches",
            "lost_updates", "ps_rows", "ps_storage", "checkpoint_s")
    shutil.rmtree(out / "run" / "checkpoints", ignore_errors=True)
    return {"case": name, "data": str(data), "capacity": capacity, "argv": argv[3:],
            **{k: result.get(k) for k in keep},
            "ps_checkpoints": ckpts, "most_added_private_bytes": max(added) if added else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", required=True,
                        help="NAME:DATA:CAPACITY: a `hybridrec data synth` directory and its ps.capacity; the "
                             "first case is the one measured, the others its baselines")
    parser.add_argument("--set", action="append", default=[], help="more --set for every case")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp"), help="where run directories go")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    extra = [x for s in args.set for x in ("--set", s)]
    work = Path(tempfile.mkdtemp(prefix="large-table-", dir=args.work))
    shm = Path(tempfile.mkdtemp(prefix="large-table-shm-", dir="/dev/shm"))
    results = []
    try:
        for case in args.case:
            name, data, capacity = case.split(":")
            results.append(run_case(name, Path(data).resolve(), int(capacity), work, shm, extra))
            shutil.rmtree(shm / name, ignore_errors=True)
            print(json.dumps({k: v for k, v in results[-1].items() if k != "ps_checkpoints"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    first = results[0]
    report = {"benchmark": "large_table", "set": args.set, "cases": results,
              "samples_per_sec_ratio": {r["case"]: round(first["samples_per_sec"] / r["samples_per_sec"], 3)
                                        for r in results[1:]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["samples_per_sec_ratio"]))


if __name__ == "__main__":
    main()
