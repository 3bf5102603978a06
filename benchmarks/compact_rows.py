"""Compact rows against float32 rows: the README example trained with each, runs alternated, in one invocation.

Each layout is `hybridrec run examples/criteo_synth.yaml` with `--set ps.storage=...` and
`--set optimizer.embedding.name=...`: float32 Adagrad (today's default), and 16-bit weights with row-wise
Adagrad (fp16 and, with --bf16, bf16). Runs alternate layout by layout (A B A B ...), so that the shared
machine's drift falls on both alike. Reported per run: eval AUC, samples/s; per layout the mean and the
difference from float32 Adagrad. The first float32 run is also exported twice, as float32 and with
`--quantize int8`, and `hybridrec predict` scores the eval file from each: their AUCs and table bytes.

    python benchmarks/compact_rows.py --data data/synth --runs 2 --out results/compact_rows.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {"fp32 adagrad": ("fp32", "adagrad"), "fp16 rowwise_adagrad": ("fp16", "rowwise_adagrad"),
           "bf16 rowwise_adagrad": ("bf16", "rowwise_adagrad")}


def run(data: Path, work: Path, shm: Path, storage: str, optimizer: str, extra: list[str]) -> dict:
    """One training run of the README example with this layout (run directory and checkpoints under `work`,
    the PS stores under `shm`); its summary's figures."""
    out = work / f"{storage}-{optimizer}"
    shutil.rmtree(out, ignore_errors=True)
    summary = out / "summary.json"
    subprocess.run([sys.executable, "-m", "hybridrec", "run", str(REPO / "examples" / "criteo_synth.yaml"),
                    "--run-dir", str(out / "run"), "--summary-json", str(summary),
                    "--set", f"data.train=[{data / 'train.tsv'}]", "--set", f"data.eval=[{data / 'eval.tsv'}]",
                    "--set", f"data.oracle={data / 'oracle.json'}",
                    "--set", f"ps.storage={storage}", "--set", f"optimizer.embedding.name={optimizer}",
                    "--set", f"ps.shm_dir={shm}", *extra],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    result = json.loads(summary.read_text())
    return {"auc": result["auc"], "oracle_auc": result.get("oracle_auc"), "samples_per_sec": result["samples_per_sec"],
            "skipped_batches": result["skipped_batches"], "lost_updates": result["lost_updates"],
            "ps_rows": result.get("ps_rows"), "ps_storage": result.get("ps_storage"), "run_dir": str(out / "run")}


def exports(run_dir: Path, data: Path, work: Path) -> dict:
    """The run exported as float32 and as int8: `hybridrec predict`'s eval AUC and the tables' bytes of each."""
    import numpy as np

    from hybridrec.core.layouts.bundle import read_manifest
    from hybridrec.core.model.evaluation import binary_metrics

    labels = np.loadtxt(data / "eval.tsv", delimiter="\t", usecols=0, dtype=np.float32)
    out = {}
    for name, extra in (("float32", []), ("int8", ["--quantize", "int8"])):
        bundle, scores = work / f"bundle-{name}", work / f"predict-{name}.csv"
        for args in (["export", str(run_dir), "--out", str(bundle), *extra],
                     ["predict", str(bundle), str(data / "eval.tsv"), "--out", str(scores)]):
            subprocess.run([sys.executable, "-m", "hybridrec", *args], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        probs = np.loadtxt(scores, delimiter=",", skiprows=1, dtype=np.float32)
        files = read_manifest(bundle).files
        out[name] = {"auc": binary_metrics(labels, probs)["auc"],
                     "table_bytes": sum(e.bytes for rel, e in files.items() if rel.endswith((".rows.npy", ".scales.npy")))}
    out["auc_difference"] = round(out["int8"]["auc"] - out["float32"]["auc"], 5)
    out["tables_smaller"] = round(out["float32"]["table_bytes"] / out["int8"]["table_bytes"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="`hybridrec data synth` output (train/eval.tsv)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="also bf16 weights")
    parser.add_argument("--set", action="append", default=[], help="more --set for every run")
    parser.add_argument("--no-export", action="store_true", help="skip the float32 / int8 exports")
    parser.add_argument("--work", type=Path, default=Path("/dev/shm"),
                        help="where the runs' directories and checkpoints go (a disk for large tables: a 100M-row "
                             "table's checkpoints do not fit in memory beside its store)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    layouts = [name for name in LAYOUTS if args.bf16 or not name.startswith("bf16")]
    extra = [x for s in args.set for x in ("--set", s)]
    work = Path(tempfile.mkdtemp(prefix="compact-rows-", dir=args.work))
    shm = Path(tempfile.mkdtemp(prefix="compact-rows-shm-", dir="/dev/shm"))
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    quantized = None
    try:
        for i in range(args.runs):
            for name in layouts:
                runs[name].append(run(args.data.resolve(), work, shm, *LAYOUTS[name], extra))
                print(name, runs[name][-1], flush=True)
                if quantized is None and name == "fp32 adagrad" and not args.no_export:
                    quantized = exports(Path(runs[name][-1]["run_dir"]), args.data.resolve(), work)
                    print("exports", quantized, flush=True)
                shutil.rmtree(Path(runs[name][-1]["run_dir"]) / "checkpoints", ignore_errors=True)  # disk, for 100M rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    mean = {name: {k: sum(r[k] for r in rs) / len(rs) for k in ("auc", "samples_per_sec")}
            for name, rs in runs.items()}
    base = mean["fp32 adagrad"]
    result = {"runs": runs, "mean": mean, "int8_export": quantized,
              "vs_fp32_adagrad": {name: {"auc_difference": round(m["auc"] - base["auc"], 5),
                                         "samples_per_sec_ratio": round(m["samples_per_sec"] / base["samples_per_sec"], 3)}
                                  for name, m in mean.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
