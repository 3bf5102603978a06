"""Your own data: the README's synthetic rows as TSV and as the Parquet file pandas writes of them, trained by the
README example (examples/criteo_synth.yaml) in one invocation. Writes JSON.

Variants, each trained --repeats times (hybrid mode has a bounded staleness, so repeats differ a little):

* tsv: the TSV file (the reader applies log1p(max(x, 0)) to the integer columns);
* parquet-none: `pd.read_csv(train.tsv, sep="\\t", names=[...]).to_parquet(...)` (int64 and float64 counts, NaN
  as null, string tokens), its counts as stored (`data.dense_transform: none`, the default);
* parquet-log1p: the same file with `data.dense_transform: log1p`;
* parquet-log1p-uint64: C1 replaced by 64-bit hashes of its tokens (uint64, half of them >= 2**63).

    python benchmarks/own_data.py --rows 200000 --out docs/measurements/own-data.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
README_CONFIG = REPO / "examples" / "criteo_synth.yaml"
NAMES = ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]


def pandas_parquet(tsv: Path, out: Path, *, uint64_c1: bool) -> Path:
    import pandas as pd

    frame = pd.read_csv(tsv, sep="\t", names=NAMES)
    if uint64_c1:
        frame["C1"] = pd.util.hash_pandas_object(frame["C1"].fillna(""), index=False).to_numpy(np.uint64)
    frame.to_parquet(out)
    return out


def train(sets: list[str], run_dir: Path) -> dict:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hybridrec", "run", str(README_CONFIG), "--run-dir", str(run_dir),
                          *[arg for s in sets for arg in ("--set", s)]], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"run failed:\n{out.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"auc": summary["auc"], "logloss": summary["logloss"], "samples": summary["samples"],
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="own-data-"))
    subprocess.run([sys.executable, "-m", "hybridrec", "data", "synth", "--out", str(work), "--rows", str(args.rows)],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    files = {}
    for uint64 in (False, True):
        for name in ("train", "eval"):
            files[name, uint64] = pandas_parquet(work / f"{name}.tsv", work / f"{name}{'-u64' if uint64 else ''}.parquet",
                                                 uint64_c1=uint64)
    oracle = f"data.oracle={work / 'oracle.json'}"
    tsv = [f"data.train=[{work / 'train.tsv'}]", f"data.eval=[{work / 'eval.tsv'}]", oracle]

    def parquet(uint64: bool, transform: str) -> list[str]:
        return [f"data.train=[{files['train', uint64]}]", f"data.eval=[{files['eval', uint64]}]", oracle,
                "data.format=parquet", f"data.dense_transform={transform}"]

    variants = {"tsv": tsv, "parquet-none": parquet(False, "none"), "parquet-log1p": parquet(False, "log1p"),
                "parquet-log1p-uint64": parquet(True, "log1p")}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for repeat in range(args.repeats):  # interleaved: the machine's load falls on every variant alike
        for name, sets in variants.items():
            runs[name].append(train(sets, work / f"{name}-{repeat}"))
            print(name, runs[name][-1], flush=True)
    base = statistics.mean(r["auc"] for r in runs["tsv"])
    result = {"rows": args.rows, "repeats": args.repeats, "config": str(README_CONFIG.relative_to(REPO)),
              "oracle_auc": json.loads((work / "oracle.json").read_text())["oracle_auc"],
              "variants": {name: {"runs": rs, "auc_mean": statistics.mean(r["auc"] for r in rs),
                                  "auc_minus_tsv": statistics.mean(r["auc"] for r in rs) - base}
                           for name, rs in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: round(v["auc_minus_tsv"], 4) for k, v in result["variants"].items()}))


if __name__ == "__main__":
    main()
