"""Tasks by kind on the synthetic Parquet data: the click + watch-time example (examples/watch_time_parquet.yaml)
trained, and its watch time's RMSE against the oracle's (the RMSE of the planted true mean); then the same data
with its negatives down-sampled (`--negative-rate`) trained weighted and unweighted, in each training mode
given, and each model's mean predicted click probability on the eval file (`hybridrec predict` of its export)
against the eval file's click rate: calibrated, and not. The unsampled run's mean prediction is the reference
for what the mode itself does to calibration. A model's mean prediction moves from run to run by a few per cent
(the dense optimizer's last steps, the order two NN workers' batches arrive in), so the weighted run is
repeated (`--repeats`) and judged by the mean of its runs, each run reported beside it.

`--stops` measures where that movement comes from: the unsampled example (hybrid mode) stopped at each of the
given steps (`training.max_steps`), at a constant dense learning rate (`optimizer.dense.decay=null`) and with the
example's fall over the last quarter of the run; each stop's mean prediction against the click rate.

    python benchmarks/tasks.py --rows 1000000 --sampled-rows 3000000 --modes sync hybrid --repeats 3 \
        --out results/tasks.json
    python benchmarks/tasks.py --modes --stops 470 474 478 482 --out results/tasks-stops.json
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
EXAMPLE = REPO / "examples" / "watch_time_parquet.yaml"


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "hybridrec", *args], check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def synth(out: Path, rows: int, negative_rate: float | None) -> dict:
    extra = ["--negative-rate", str(negative_rate)] if negative_rate else []
    cli("data", "synth", "--format", "parquet", "--out", str(out), "--rows", str(rows), *extra)
    return json.loads((out / "oracle.json").read_text())


def train(data: Path, run: Path, *sets: str) -> dict:
    """The example on `data`; its summary, and the mean of each task's predictions on the eval file."""
    import pyarrow.parquet as pq

    args = ["run", str(EXAMPLE), "--run-dir", str(run), "--set", f"data.train=[{data / 'train.parquet'}]",
            "--set", f"data.eval=[{data / 'eval.parquet'}]", "--set", f"data.oracle={data / 'oracle.json'}"]
    for item in sets:
        args += ["--set", item]
    cli(*args)
    cli("export", str(run), "--out", str(run / "bundle"))
    cli("predict", str(run / "bundle"), str(data / "eval.parquet"), "--out", str(run / "predicted.parquet"))
    predicted = pq.read_table(run / "predicted.parquet")
    summary = json.loads((run / "summary.json").read_text())
    return {"tasks": summary["tasks"], "samples_per_sec": summary["samples_per_sec"], "steps": summary["steps"],
            "train_rows": summary["data"]["train"]["rows"],
            "mean_prediction": {c: float(predicted[c].to_numpy().mean()) for c in predicted.column_names}}


def stops(data: Path, work: Path, steps: list[int], rate: float) -> dict:
    """Each stop's calibration (mean predicted click / the eval click rate), at a constant rate and falling."""
    out = {}
    for name, extra in (("constant", ("optimizer.dense.decay=null",)), ("decay", ())):
        runs = [train(data, work / f"stop-{name}-{step}", f"training.max_steps={step}", *extra) for step in steps]
        out[name] = {str(step): {"calibration": round(run["mean_prediction"]["click"] / rate, 4),
                                 "auc": round(run["tasks"][0]["auc"], 5)} for step, run in zip(steps, runs)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="training rows of the unsampled data")
    parser.add_argument("--sampled-rows", type=int, default=3_000_000,
                        help="training rows drawn before down-sampling the negatives")
    parser.add_argument("--negative-rate", type=float, default=0.1)
    parser.add_argument("--sampled-epochs", type=int, default=1, help="epochs over the down-sampled data")
    parser.add_argument("--modes", nargs="*", default=["sync", "hybrid"], help="training modes of every run")
    parser.add_argument("--stops", nargs="*", type=int, default=[],
                        help="steps to stop the unsampled hybrid run at, constant rate against falling")
    parser.add_argument("--repeats", type=int, default=1, help="weighted down-sampled runs a mode")
    parser.add_argument("--work", type=Path, default=None, help="where data and runs go (default: a temp dir)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tasks-", dir=args.work))
    try:
        oracle = synth(work / "data", args.rows, None)["tasks"]
        result = {"rows": args.rows, "sampled_rows": args.sampled_rows, "sampled_epochs": args.sampled_epochs,
                  "negative_rate": args.negative_rate, "modes": {}}
        if args.stops:
            result["stops"] = stops(work / "data", work, args.stops, oracle["click"]["eval_rate"])
        if args.modes:
            sampled = synth(work / "sampled", args.sampled_rows, args.negative_rate)
            rate = result["eval_click_rate"] = sampled["tasks"]["click"]["eval_rate"]
        for mode in args.modes:
            full = train(work / "data", work / f"full-{mode}", f"training.mode={mode}")
            watch = next(t for t in full["tasks"] if t["name"] == "watch_time")
            click = next(t for t in full["tasks"] if t["name"] == "click")
            sampled_sets = (f"training.mode={mode}", f"training.epochs={args.sampled_epochs}")
            weighted = [train(work / "sampled", work / f"weighted-{mode}-{k}", *sampled_sets)
                        for k in range(args.repeats)]
            unweighted = train(work / "sampled", work / f"unweighted-{mode}", *sampled_sets, "data.weight_column=null")
            ratios = [round(run["mean_prediction"]["click"] / rate, 4) for run in weighted]
            result["modes"][mode] = {
                "full": full, "sampled": {"weighted": weighted, "unweighted": unweighted},
                "watch_time_rmse_vs_oracle": round(watch["rmse"] / oracle["watch_time"]["oracle_rmse"], 4),
                "watch_time_rmse_of_the_mean": oracle["watch_time"]["mean_rmse"],
                "click_auc_vs_oracle": round(click["auc"] - oracle["click"]["oracle_auc"], 5),
                "full_calibration": round(full["mean_prediction"]["click"] / oracle["click"]["eval_rate"], 4),
                "calibration": {"weighted_runs": ratios, "weighted": round(sum(ratios) / len(ratios), 4),
                                "unweighted": round(unweighted["mean_prediction"]["click"] / rate, 4)}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps({"stops": result.get("stops"), **{
            mode: {k: v for k, v in figures.items() if k not in ("full", "sampled")}
            for mode, figures in result["modes"].items()}}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
