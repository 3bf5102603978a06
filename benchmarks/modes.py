"""Accuracy-throughput benchmark of the training modes against single-process PyTorch and TorchRec.

In one run, on the same synthetic data (prepared once with `hybridrec data
prepare`; --raw: the TSV files), model (DNN 512-256-128 over 26 x 16
embeddings + 13 dense features), batch size (4096) and optimizers (Adagrad on
embeddings, Adam on the MLP):

* hybridrec `hybrid`, `sync`, `async` and `shadow` (2 NN workers, 2 PS shards,
  1 embedding worker), each a full `hybridrec run`;
* baselines from benchmarks/baselines.py: single-process PyTorch and TorchRec
  on CPU (DistributedModelParallel, fused FBGEMM kernel, optimizer in backward).

Writes JSON (modes.<mode>.{samples_per_sec, auc}, baselines.<name>.{...} and the
ratios in `targets`; per mode an `accounting` table: core-seconds per 1M training
samples of each service (CPU time of its processes during training, psutil), the
MLP's share (the same model's forward, backward and Adam step timed alone on one
thread) and the overhead outside it) and a PNG that compares like with like: one point per
system, its eval AUC on the same held-out file after the same training samples
(one epoch) against its training wall time (`auc_points`). The JSON keeps each
system's curve with its kind (hybridrec: progressive-validation AUC of rank 0;
baselines: eval AUC at a few points), but the two measures are never drawn on
one axis.

    python benchmarks/modes.py --quick --out results/modes.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hybridrec.core.layouts.summary import RunSummary  # noqa: E402

MODES = ("hybrid", "sync", "async", "shadow")
BASELINES = ("pytorch", "torchrec")


def prepare(data: Path, work: Path) -> Path:
    """`hybridrec data prepare` of train.tsv and eval.tsv into work/prepared (once; re-used while the sources are
    unchanged): hybridrec then slices memory-mapped arrays as the baselines index their in-memory tensors."""
    out = work / "prepared"
    for name in ("train", "eval"):
        target = out / name
        manifest = target / "manifest.json"
        source = data / f"{name}.tsv"
        if manifest.exists():
            prepared_from = json.loads(manifest.read_text())["sources"][0]
            if prepared_from["mtime_ns"] == source.stat().st_mtime_ns:
                continue
        subprocess.run([sys.executable, "-m", "hybridrec", "data", "prepare", str(source), "--out", str(target),
                        "--force"], cwd=REPO, check=True, capture_output=True)
    return out


def hybridrec_config(data: Path, out: Path, prepared: Path | None = None) -> Path:
    train, evaluate = ((prepared / "train", prepared / "eval") if prepared is not None
                       else (data / "train.tsv", data / "eval.tsv"))
    tree = {
        "data": {"train": [str(train)], "eval": [str(evaluate)],
                 "oracle": str(data / "oracle.json")},
        "model": {"path": "hybridrec.models:DNN", "kwargs": {"hidden": [512, 256, 128]}},
        "optimizer": {"embedding": {"name": "adagrad", "lr": 0.05}, "dense": {"name": "adam", "lr": 0.001}},
        "training": {"batch_size": 4096, "epochs": 1, "staleness": 1, "prefetch": 2},
        "ps": {"capacity": 4_000_000},
        "cluster": {"ps": ["127.0.0.1:0"] * 2, "embedding_workers": ["127.0.0.1:0"],
                    "nn_workers": ["127.0.0.1:0"] * 2},
    }
    out.write_text(yaml.safe_dump(tree))
    return out


def run_mode(config: Path, mode: str, work: Path, overrides: list[str]) -> dict:
    run_dir = work / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier invocation's checkpoints would resume it at its end
    started = time.monotonic()
    sets = [arg for o in overrides for arg in ("--set", o)]
    result = subprocess.run([sys.executable, "-m", "hybridrec", "run", str(config), "--set", f"training.mode={mode}",
                             *sets, "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"hybridrec run ({mode}) failed:\n{result.stderr[-3000:]}")
    summary = RunSummary.of_run(run_dir)
    series = json.loads((run_dir / "series.json").read_text())
    phases = series.get("phases") or {}
    t0, t1 = phases.get("first_step"), phases.get("end_of_training")
    train = [p for p in series["training"] if p["phase"] == "train" and (t0 is None or p["t"] >= t0)]
    t0 = t0 if t0 is not None else (train[0]["t"] if train else 0.0)
    t1 = t1 if t1 is not None else (train[-1]["t"] if train else 0.0)
    rank0 = [(p["t"] - t0, r["train_auc"]) for p in train for r in p["ranks"] if r["rank"] == 0]
    curve = [(t, auc) for t, auc in rank0 if auc is not None and auc == auc]
    return {"cpu_percent": cpu_during(series["resources"], t0, t1),
            "accounting": accounting(series["resources"], t0, t1, summary.samples, mlp_core_s_per_1m(),
                                     summary.compute_cpu_s),
            "samples_per_sec": summary.samples_per_sec,
            "auc": summary.auc, "logloss": summary.logloss,
            "train_wall_s": summary.train_wall_s, "wall_s": time.monotonic() - started,
            "samples": summary.samples, "staleness": summary.staleness.model_dump(mode="json"), "curve": curve,
            "curve_kind": "progressive validation AUC (per NN worker, rank 0)", "oracle_auc": summary.oracle_auc}


def cpu_during(resources: dict[str, list[dict]], t0: float, t1: float) -> dict[str, float]:
    """Mean CPU % of every service while training ran (100 = one core busy), and their total.

    On one machine every mode does the same CPU work per sample, so a mode can only
    be faster than another by the CPU time the other leaves idle: the totals say how
    much that is (docs/benchmarks.md)."""
    out: dict[str, float] = {}
    for name, points in resources.items():
        values = [p["cpu_percent"] for p in points if t0 <= p["t"] <= t1]
        if values:
            out[name] = round(sum(values) / len(values), 1)
    out["total"] = round(sum(out.values()), 1)
    return out


def core_seconds(points: list[dict], t0: float, t1: float) -> float:
    """CPU seconds a service's process(es) spent in [t0, t1], from cumulative `cpu_s` samples (linear in between;
    a counter that drops is a restarted process, counted from zero)."""
    points = sorted((p for p in points if "cpu_s" in p), key=lambda p: p["t"])
    total = 0.0
    for a, b in zip(points, points[1:]):
        if b["t"] <= a["t"]:
            continue
        used = b["cpu_s"] - a["cpu_s"] if b["cpu_s"] >= a["cpu_s"] else b["cpu_s"]
        overlap = max(0.0, min(b["t"], t1) - max(a["t"], t0))
        total += used * overlap / (b["t"] - a["t"])
    return total


def service_kind(name: str) -> str:
    """`embedding_ps-1` -> `embedding_ps`: replicas are summed per service."""
    return name.rsplit("-", 1)[0]


def accounting(resources: dict[str, list[dict]], t0: float, t1: float, samples: int, mlp_per_1m: float,
               step_cpu_s: float | None = None) -> dict:
    """Core-seconds per 1M training samples by service, the MLP's share and the overhead outside it.

    The MLP costs the same in every system (same model, batch and precision); what hybridrec spends around it
    (parsing, dedup, routing, the PS, pooling, RPCs, the NN workers' own loop) is `overhead_core_s_per_1m`.
    The MLP's share is timed alone on an idle core; in a run, with every core busy, the same step costs more.
    `step_core_s_per_1m` is the NN workers' compute threads' CPU in their training steps as the run went
    (pooling, MLP, optimizer: the summary's `compute_cpu_s`), and `outside_step_core_s_per_1m` what every
    process spent outside those steps: the overhead with the contention on the model's step left out."""
    per_1m: dict[str, float] = {}
    for name, points in resources.items():
        kind = service_kind(name)
        per_1m[kind] = per_1m.get(kind, 0.0) + core_seconds(points, t0, t1) * 1e6 / max(samples, 1)
    total = sum(per_1m.values())
    nn = per_1m.get("nn_worker", 0.0)
    return {"samples": samples, "window_s": round(t1 - t0, 3),
            "core_s_per_1m": {k: round(v, 2) for k, v in sorted(per_1m.items())} | {"total": round(total, 2)},
            "mlp_core_s_per_1m": round(mlp_per_1m, 2),
            "nn_worker_outside_mlp_core_s_per_1m": round(nn - mlp_per_1m, 2),
            "overhead_core_s_per_1m": round(total - mlp_per_1m, 2)} | ({} if step_cpu_s is None else {
            "step_core_s_per_1m": round(step_cpu_s * 1e6 / max(samples, 1), 2),
            "outside_step_core_s_per_1m": round(total - step_cpu_s * 1e6 / max(samples, 1), 2)})


_MLP_CACHE: dict[tuple, float] = {}


def thread_cpu_s_per_call(fn: Callable[[], object], calls: int) -> float:
    """This thread's CPU seconds per call of `fn`, after one call to warm it up (the thread's CPU clock: a busy
    machine does not inflate it)."""
    fn()
    started = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - started) / calls


def mlp_core_s_per_1m(hidden: tuple[int, ...] = (512, 256, 128), batch: int = 4096, steps: int = 20) -> float:
    """CPU seconds per 1M samples of the benchmark's MLP alone: forward, backward and Adam step on one thread
    (torch_threads is 1 per NN worker), timed with the thread's CPU clock so a busy machine does not inflate it."""
    key = (hidden, batch, steps)
    if key in _MLP_CACHE:
        return _MLP_CACHE[key]
    import torch

    from hybridrec.core.config import Config
    from hybridrec.core.model.models import DNN, FeatureInfo

    config = Config.model_validate({"data": {"train": ["unused"]}, "cluster": {"ps": ["127.0.0.1:1"]}})
    features = [FeatureInfo(f.name, f.dim) for f in config.features]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = DNN(features=features, num_dense=config.num_dense, hidden=list(hidden))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        dense = torch.randn(batch, config.num_dense, generator=gen)
        emb = {f.name: torch.randn(batch, f.dim, generator=gen, requires_grad=True) for f in features}
        labels = torch.randint(0, 2, (batch,), generator=gen).float()

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.binary_cross_entropy_with_logits(model(dense, emb), labels).backward()
            opt.step()

        _MLP_CACHE[key] = thread_cpu_s_per_call(step, steps) / batch * 1e6
    finally:
        torch.set_num_threads(threads)
    return _MLP_CACHE[key]


def run_baseline(name: str, data: Path, work: Path, prepared: Path | None = None) -> dict:
    out = work / f"baseline-{name}.json"
    extra = ["--prepared", str(prepared)] if prepared is not None else []
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "baselines.py"), "--data", str(data),
                             *extra, "--which", name, "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"baseline {name} failed:\n{result.stderr[-3000:]}")
    raw = json.loads(out.read_text())
    entry = raw["baselines"][name]
    return {"samples_per_sec": entry["samples_per_sec"], "auc": entry["auc"], "logloss": entry.get("logloss"),
            "train_wall_s": entry.get("train_wall_s"), "samples": entry.get("samples"),
            "curve": [tuple(p) for p in entry.get("curve", [])], "curve_kind": "eval AUC",
            "details": entry.get("details", {})}


AUC_AXIS = "eval AUC on the held-out file"


def auc_points(result: dict) -> list[dict]:
    """What the PNG draws: one point per system (hybridrec modes and baselines) with the same measure,
    the eval AUC on the held-out file after training, at its training wall time. Systems without an
    eval AUC or a wall time are left out; `samples` says how many training samples each saw."""
    points = []
    for group in ("modes", "baselines"):
        for name, entry in result.get(group, {}).items():
            auc, wall = entry.get("auc"), entry.get("train_wall_s")
            if auc is None or not wall:
                continue
            points.append({"name": name, "group": group, "auc": float(auc), "train_wall_s": float(wall),
                           "samples": entry.get("samples"), "samples_per_sec": entry.get("samples_per_sec")})
    return points


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = auc_points(result)
    samples = {p["samples"] for p in points if p["samples"]}
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, p in enumerate(points):
        marker = "o" if p["group"] == "modes" else "s"
        label = f"{'hybridrec ' if p['group'] == 'modes' else ''}{p['name']}: AUC {p['auc']:.4f}, " \
                f"{(p['samples_per_sec'] or 0):,.0f} samples/s"
        ax.plot([p["train_wall_s"]], [p["auc"]], marker, ms=8, color=f"C{i % 10}", label=label)
    oracle = result.get("oracle_auc")
    if oracle is not None:
        ax.axhline(oracle, color="grey", ls=":", label=f"oracle AUC {oracle:.4f} (best possible)")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel(AUC_AXIS)
    after = f"after {next(iter(samples)):,} training samples" if len(samples) == 1 else "after one epoch"
    ax.set_title(f"Eval AUC on the same held-out file {after}, against training time")
    ax.set_xlim(left=0)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "synth")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows to synthesize when --data has none")
    parser.add_argument("--quick", action="store_true", help="one epoch of the 1M-row example (about 10 minutes)")
    parser.add_argument("--only", nargs="*", default=None, help="subset of modes/baselines to run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every hybridrec run (e.g. training.precision=bf16); the "
                             "baselines do not see it")
    parser.add_argument("--raw", action="store_true", help="every system reads the TSV files (hybridrec parsing "
                        "them every epoch) instead of the data prepared once")
    args = parser.parse_args()
    if not (args.data / "train.tsv").exists():
        from hybridrec.app.data.synth import synthesize
        synthesize(args.data, rows=args.rows)
    work = args.out.parent / (args.out.stem + "-work")
    work.mkdir(parents=True, exist_ok=True)
    prepared = None if args.raw else prepare(args.data, work)
    config = hybridrec_config(args.data, work / "config.yaml", prepared)
    wanted = set(args.only) if args.only else set(MODES) | set(BASELINES)
    started = time.monotonic()
    result: dict = {"benchmark": "modes", "data": str(args.data), "prepared": prepared is not None,
                    "overrides": args.overrides, "modes": {},
                    "baselines": {}}
    for mode in MODES:
        if mode in wanted:
            result["modes"][mode] = run_mode(config, mode, work, args.overrides)
            print(mode, {k: result["modes"][mode][k] for k in ("samples_per_sec", "auc")}, flush=True)
    for name in BASELINES:
        if name in wanted:
            result["baselines"][name] = run_baseline(name, args.data, work, prepared)
            print(name, {k: result["baselines"][name][k] for k in ("samples_per_sec", "auc")}, flush=True)
    modes, base = result["modes"], result["baselines"]
    ratio = lambda a, b: a["samples_per_sec"] / b["samples_per_sec"] if a and b else None  # noqa: E731
    h = modes.get("hybrid")
    result["targets"] = {
        "hybrid_vs_sync_throughput": ratio(h, modes.get("sync")),
        "hybrid_minus_sync_auc": h["auc"] - modes["sync"]["auc"] if h and modes.get("sync") else None,
        "hybrid_vs_async_throughput": ratio(h, modes.get("async")),
        "hybrid_vs_pytorch_throughput": ratio(h, base.get("pytorch")),
        "hybrid_vs_torchrec_throughput": ratio(h, base.get("torchrec")),
    }
    if h and modes.get("sync"):
        # Ceiling of hybrid/sync on this machine: hybrid can at most fill the cores sync leaves idle.
        result["targets"]["hybrid_vs_sync_cpu_ceiling"] = (100.0 * (os.cpu_count() or 1)
                                                          / max(modes["sync"]["cpu_percent"]["total"], 1.0))
    result["cpus"] = os.cpu_count()
    result["wall_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["oracle_auc"] = next((m.get("oracle_auc") for m in modes.values() if m.get("oracle_auc")), None)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["targets"], indent=2))


if __name__ == "__main__":
    main()
