"""What `ps.replicas: 2` costs: the README example run alternately with one copy of each PS shard and with two,
`--repeats` times each, on one machine in one invocation. Writes JSON.

Per run: samples/s, eval AUC, and the memory the PS stores hold in /dev/shm at the end of training (the
bytes tmpfs allocated for the run's `shard-*` and `backup-*` directories: pages are allocated when first
written, so this is what the stores occupy, not their reserved size). The ratio compared with the issue's
bound (0.8) is of the median samples/s.

    python benchmarks/replicas.py --rows 1000000 --repeats 3 --out results/replicas.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hybridrec.core.layouts.summary import RunSummary  # noqa: E402

README_CONFIG = REPO / "examples" / "criteo_synth.yaml"


def allocated_bytes(directory: Path) -> int:
    """Bytes the filesystem allocated for the files under `directory` (tmpfs: the pages written)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def run_once(config: Path, run_dir: Path, replicas: int) -> dict:
    shm_root = Path(tempfile.mkdtemp(prefix="hybridrec-replicas-", dir="/dev/shm"))
    cmd = [sys.executable, "-m", "hybridrec", "run", str(config), "--run-dir", str(run_dir), "--set",
           f"ps.replicas={replicas}", "--set", f"ps.shm_dir={shm_root}", "--set", "ps.keep_shm=true"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"hybridrec run (ps.replicas={replicas}) failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        (run,) = [p for p in shm_root.iterdir() if p.is_dir() and p.name.startswith("run-")]
        shards = sum(allocated_bytes(p) for p in run.glob("shard-*"))
        backups = sum(allocated_bytes(p) for p in run.glob("backup-*"))
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    summary = RunSummary.of_run(run_dir)
    return {"replicas": replicas, "samples_per_sec": summary.samples_per_sec, "auc": summary.auc,
            "lost_updates": summary.lost_updates, "skipped_batches": summary.skipped_batches,
            "train_wall_s": summary.train_wall_s, "shard_bytes": shards, "backup_bytes": backups}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="directory with train.tsv, eval.tsv, oracle.json (data/synth)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic rows when --data is not given")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridrec-replicas-") as scratch:
        work = Path(scratch)
        data = args.data
        if data is None:
            data = work / "data"
            subprocess.run([sys.executable, "-m", "hybridrec", "data", "synth", "--out", str(data), "--rows",
                            str(args.rows)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        tree = yaml.safe_load(README_CONFIG.read_text())
        tree["data"] = {"train": [str(data / "train.tsv")], "eval": [str(data / "eval.tsv")],
                        "oracle": str(data / "oracle.json")}
        config = work / "config.yaml"
        config.write_text(yaml.safe_dump(tree))
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for repeat in range(args.repeats):  # alternated: the machine's load drifts
            for replicas in (1, 2):
                runs[replicas].append(run_once(config, work / f"r{replicas}-{repeat}", replicas))
    median = {r: statistics.median(x["samples_per_sec"] for x in rs) for r, rs in runs.items()}
    result = {"benchmark": "replicas", "cpus": os.cpu_count(), "data": str(args.data or f"synthetic {args.rows} rows"),
              "runs": {f"replicas_{r}": rs for r, rs in runs.items()},
              "median_samples_per_sec": {f"replicas_{r}": m for r, m in median.items()},
              "throughput_ratio": median[2] / median[1],
              "target_ratio": 0.8,
              "memory_ratio": statistics.median((x["shard_bytes"] + x["backup_bytes"]) / x["shard_bytes"]
                                                for x in runs[2]),
              "auc_difference": statistics.median(x["auc"] for x in runs[2]) - statistics.median(x["auc"]
                                                                                                for x in runs[1])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
