"""Sweep: training modes x link rates of the embedding host, across two testbed hosts.

The `trainer` host runs the data loader and the NN workers, the `embedding`
host the PS shards and the embedding worker; the embedding host's link is
shaped both ways (tbf) to each rate of the ladder. Each (mode, rate) is one
full testbed run of the README example's model (examples/criteo_synth.yaml).
Writes JSON (per run: samples/s, eval AUC, per-host CPU, bytes per link,
exposed wait, compute and bytes per step; and the targets) and a PNG of
samples/s against link rate, one line per mode.

    python benchmarks/testbed_sweep.py --out results/testbed.json            # 1M rows, full ladder
    python benchmarks/testbed_sweep.py --quick --out results/testbed.json    # 100k rows, 4 rates

Rates are per direction. A CPU step here takes about a second, two orders of
magnitude more than on a GPU, so a link rate here stands for a correspondingly
faster link next to GPUs: compare bytes per step / link rate with compute per
step (both in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.testbed.bed import TestbedError, run_testbed  # noqa: E402
from benchmarks.testbed.interference import cpu_interference  # noqa: E402
from benchmarks.testbed.spec import cpus_option, format_rate, parse_rate, two_hosts  # noqa: E402
from hybridrec.core.config import load_config  # noqa: E402

MODES = ("hybrid", "sync", "async")
FULL_RATES = ("unshaped", "1gbit", "200mbit", "100mbit", "50mbit", "25mbit", "12mbit")
QUICK_RATES = ("unshaped", "100mbit", "25mbit", "12mbit")


def ensure_data(rows: int) -> Path:
    data = REPO / "data" / ("synth" if rows == 1_000_000 else f"synth-{rows // 1000}k")
    if not (data / "train.tsv").exists():
        subprocess.run([sys.executable, "-m", "hybridrec", "data", "synth", "--out", str(data), "--rows", str(rows)],
                       cwd=REPO, check=True)
    return data


def one(config_path: Path, data: Path, mode: str, rate: str, work: Path, overrides: list[str],
        prefix: str, cpus: tuple[str, str] | None = None, loader_host: bool = False) -> dict:
    sets = [f"data.train=[{data / 'train.tsv'}]", f"data.eval=[{data / 'eval.tsv'}]",
            f"data.oracle={data / 'oracle.json'}", f"training.mode={mode}", *overrides]
    config = load_config(config_path, sets)
    run_dir = work / f"{mode}-{rate}"
    started = time.monotonic()
    try:
        result = run_testbed(config, two_hosts(rate, cpus=cpus, loader_host=loader_host), run_dir, prefix=prefix, timeout_s=1800)
    except TestbedError as exc:
        return {"mode": mode, "rate": rate, "error": str(exc)[-2000:]}
    s = result["summary"]
    emb = result["train"]["links"]["embedding"]
    row = {
        "mode": mode, "rate": rate, "rate_bits": parse_rate(rate),
        "samples_per_sec": s["samples_per_sec"], "auc": s["auc"], "oracle_auc": s["oracle_auc"],
        "steps": s["steps"], "train_wall_s": s["train_wall_s"],
        "exposed_wait_per_step_s": s["exposed_wait_per_step_s"], "compute_per_step_s": s["compute_per_step_s"],
        "step_s": s["train_wall_s"] / max(s["steps"], 1),
        "bytes_per_step": result["bytes_per_step"]["embedding"],
        "bytes_per_step_each_way": {"to_embedding": round(emb["rx_bytes"] / max(s["steps"], 1)),
                                    "from_embedding": round(emb["tx_bytes"] / max(s["steps"], 1))},
        "links_train": result["train"]["links"], "cpu_s_train": result["train"]["cpu_s"],
        "cpu_s_total": result["cpu_per_host_s"],
        "lost_updates": s["lost_updates"], "skipped_batches": s["skipped_batches"],
        "staleness": s["staleness"], "run_wall_s": round(time.monotonic() - started, 1),
        "load_avg": os.getloadavg(),
    }
    row["exposed_fraction"] = row["exposed_wait_per_step_s"] / row["step_s"] if row["step_s"] else None
    return row


def targets(runs: list[dict]) -> dict:
    """The targets at the fastest rate where sync's exposed wait is at least a third of its step (`rate`, the
    figures at top level), and the same four ratios at every slower rate where that holds (`by_rate`), with
    the rates where all four are met (`met_at`)."""
    ok = {(r["mode"], r["rate"]): r for r in runs if "error" not in r}
    rates = sorted(dict.fromkeys(r["rate"] for r in runs), key=lambda r: -(parse_rate(r) or float("inf")))
    qualifying = [rate for rate in rates
                  if (ok.get(("sync", rate)) or {}).get("exposed_fraction", 0) >= 1 / 3 and ("hybrid", rate) in ok]
    if not qualifying:
        return {"rate": None,
                "note": "no rate of the ladder made sync's exposed wait >= 1/3 of its step (or hybrid failed there)"}
    by_rate = {rate: _ratios(ok, rate) for rate in qualifying}
    return {"rate": qualifying[0], **by_rate[qualifying[0]], "by_rate": by_rate,
            "met_at": [rate for rate, t in by_rate.items() if all(t["met"].values())]}


def _ratios(ok: dict, rate: str) -> dict:
    h, s = ok[("hybrid", rate)], ok[("sync", rate)]
    a = ok.get(("async", rate))
    h0 = ok.get(("hybrid", "unshaped"))
    out = {
        "sync_exposed_fraction": s["exposed_fraction"],
        "hybrid_over_sync": h["samples_per_sec"] / s["samples_per_sec"],
        "hybrid_over_sync_target": 1.5,
        "hybrid_over_own_unshaped": h["samples_per_sec"] / h0["samples_per_sec"] if h0 else None,
        "hybrid_over_own_unshaped_target": 0.9,
        "auc_hybrid_minus_sync": (h["auc"] - s["auc"]) if h["auc"] is not None and s["auc"] is not None else None,
        "auc_target": -0.001,
        "async_over_hybrid": a["samples_per_sec"] / h["samples_per_sec"] if a else None,
        "async_over_hybrid_target": 1.2,
        # What hybrid would reach if overlapping did not slow its compute: sync's step over sync's compute.
        "hybrid_compute_over_sync_compute": h["compute_per_step_s"] / s["compute_per_step_s"],
    }
    out["met"] = {
        "hybrid_over_sync": out["hybrid_over_sync"] >= 1.5,
        "hybrid_over_own_unshaped": out["hybrid_over_own_unshaped"] is not None and out["hybrid_over_own_unshaped"] >= 0.9,
        "auc": out["auc_hybrid_minus_sync"] is not None and out["auc_hybrid_minus_sync"] >= -0.001,
        "async_over_hybrid": out["async_over_hybrid"] is not None and out["async_over_hybrid"] <= 1.2,
    }
    return out


def plot(runs: list[dict], path: Path) -> None:
    """Left: samples/s against link rate, one line per mode; right: exposed wait per step (the part that does
    not depend on how busy the shared CPU was)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in runs if "error" not in r]
    shaped = [r["rate_bits"] for r in ok if r["rate_bits"]]
    unshaped_x = (max(shaped) * 4) if shaped else 1e10
    x_of = lambda r: (r["rate_bits"] or unshaped_x) / 1e6  # noqa: E731
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, ax, label in (("samples_per_sec", axes[0], "training samples/s"),
                           ("exposed_wait_per_step_s", axes[1], "exposed wait per step, s")):
        for mode in MODES:
            pts = sorted((x_of(r), r[key]) for r in ok if r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ticks = sorted({x_of(r): r["rate"] for r in ok}.items())
        ax.set_xscale("log")
        ax.set_xticks([t for t, _ in ticks], [name for _, name in ticks])
        ax.minorticks_off()
        ax.set_xlabel("embedding host link rate, each direction")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("hybridrec across testbed hosts: the embedding host's link shaped")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list[Path], out: Path) -> int:
    parts = [json.loads(p.read_text()) for p in paths]
    runs: dict[tuple[str, str], dict] = {}
    for part, path in zip(parts, paths):
        for run in part["runs"]:
            runs[(run["mode"], run["rate"])] = {**run, "from": str(path)}
    result = {**parts[0], "merged_from": [str(p) for p in paths], "runs": list(runs.values()),
              "load_avg_start": [p["load_avg_start"] for p in parts], "load_avg_end": [p.get("load_avg_end") for p in parts]}
    result["targets"] = targets(result["runs"])
    out.write_text(json.dumps(result, indent=1))
    plot(result["runs"], out.with_suffix(".png"))
    print(json.dumps(result["targets"], indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/testbed.json"))
    parser.add_argument("--quick", action="store_true", help="100k rows and 4 rates")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--rates", nargs="*", default=None)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "criteo_synth.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="config override for every run, e.g. training.staleness=8")
    parser.add_argument("--prefix", default="hrsw")
    parser.add_argument("--cpus", default="split",
                        help="'split' (default): the trainer host on one half of the CPUs, the embedding host on "
                             "the other, as separate machines would be; 'shared': both on every CPU; or "
                             "TRAINER/EMBEDDING CPU lists, e.g. 0/1")
    parser.add_argument("--loader-host", action="store_true",
                        help="the data loader on a host of its own (unshaped link, the embedding host's CPUs), "
                             "as Persia deploys it; the trainer host then runs only the NN workers")
    parser.add_argument("--merge", nargs="+", type=Path, default=None,
                        help="combine sweep JSON files into --out (a later file's (mode, rate) run replaces an "
                             "earlier one), recompute the targets and the plot; runs nothing")
    args = parser.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    rates = args.rates or list(QUICK_RATES if args.quick else FULL_RATES)
    try:
        cpus = cpus_option(args.cpus)
        for rate in rates:
            parse_rate(rate)  # refuse a bad ladder before the first run
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    data = ensure_data(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.parent / (args.out.stem + "-runs")
    result = {"rows": rows, "rates": rates, "modes": args.modes, "overrides": args.overrides,
              "load_avg_start": os.getloadavg(), "cpus": os.cpu_count(),
              "host_cpus": {"trainer": cpus[0], "embedding": cpus[1]} if cpus else "shared",
              "loader_host": args.loader_host, "runs": []}
    if cpus:  # how independent the two hosts' CPUs are on this machine (1.0: like separate machines)
        result["cpu_interference"] = cpu_interference(*cpus)
        print(json.dumps({"cpu_interference": result["cpu_interference"]}), flush=True)
    for rate in rates:
        for mode in args.modes:
            row = one(args.config, data, mode, rate, work, args.overrides, args.prefix, cpus, args.loader_host)
            result["runs"].append(row)
            print(json.dumps({k: row.get(k) for k in ("mode", "rate", "samples_per_sec", "auc",
                                                      "exposed_wait_per_step_s", "compute_per_step_s",
                                                      "bytes_per_step", "load_avg", "error")}), flush=True)
            result["targets"] = targets(result["runs"])
            result["load_avg_end"] = os.getloadavg()
            args.out.write_text(json.dumps(result, indent=1))
            plot(result["runs"], args.out.with_suffix(".png"))  # after every run: a cut-short sweep keeps its plot
    print(json.dumps(result["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
