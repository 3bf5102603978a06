"""GPU benchmark: the README example with its NN workers on GPUs over NCCL, against the same run on the CPU.
Writes JSON. Needs a CUDA build of torch and at least one GPU; measures, in one invocation on one machine:

* `cpu`: the example with `training.backend=gloo` (the accuracy reference);
* `nccl_overlap` and `nccl_sync_copies`: NN workers on GPUs, with `training.overlap_copies` on and off, run
  alternately `--repeats` times; samples/s of each and their ratio (the overlap's gain), eval AUC of each and
  its difference from the CPU run's (the issue's bound: 0.005);
* with `--kill` and at least two GPUs: rank 1 SIGKILLed once rank 0 has trained 30% of its steps, on NCCL; the
  run must replace it (its peer hands over the dense state) and end with 0 skipped batches and 0 lost updates;
* with `--kill` and one GPU (one NN worker): that rank SIGKILLed after the first interval checkpoint, at 30% of
  its steps; nobody holds the dense state, so its replacement resumes on NCCL from the checkpoint the GPU
  wrote (the group-loss path, not the hand-over).

NN workers: one per GPU, at most the example's two (`--nn-workers` to choose). The data is --data DIR
(train.tsv, eval.tsv, oracle.json: the README's data/synth) or, without it, --rows synthetic rows written first.

    python benchmarks/gpu.py --rows 1000000 --kill --out results/gpu.json
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from hybridrec.app.launcher import rank_step
from hybridrec.summary import RunSummary, read_services

REPO = Path(__file__).resolve().parents[1]
README_CONFIG = REPO / "examples" / "criteo_synth.yaml"


def write_config(data: Path, out: Path, nn_workers: int) -> Path:
    tree = yaml.safe_load(README_CONFIG.read_text())
    tree["data"] = {"train": [str(data / "train.tsv")], "eval": [str(data / "eval.tsv")],
                    "oracle": str(data / "oracle.json")}
    tree.setdefault("cluster", {})["nn_workers"] = ["127.0.0.1:0"] * nn_workers
    out.write_text(yaml.safe_dump(tree))
    return out


def checkpointed(run_dir: Path) -> bool:
    """Whether the run has a complete interval checkpoint (renamed into place, no longer .tmp)."""
    return any(not m.parent.name.endswith(".tmp") for m in (run_dir / "checkpoints").glob("step-*/manifest.json"))


def run(config: Path, run_dir: Path, sets: list[str], kill_at_step: int | None = None, kill_replica: int = 1) -> dict:
    cmd = [sys.executable, "-m", "hybridrec", "run", str(config), "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = None
    if kill_at_step is not None:
        import psutil

        pattern = f"serve nn_worker --config {run_dir / 'config.yaml'} --replica {kill_replica}"
        while proc.poll() is None and killed is None:
            step = rank_step(run_dir)
            if step is not None and step >= kill_at_step and (kill_replica != 0 or checkpointed(run_dir)):
                for p in psutil.process_iter(["cmdline"]):
                    if pattern in " ".join(p.info["cmdline"] or []):
                        p.send_signal(signal.SIGKILL)
                        killed = step
            time.sleep(0.2)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"hybridrec run {' '.join(sets)} failed ({proc.returncode}):\n{err[-3000:]}")
    summary = RunSummary.of_run(run_dir)
    keep = ("samples_per_sec", "auc", "logloss", "samples", "steps", "skipped_batches", "lost_updates",
            "train_wall_s", "exposed_wait_per_step_s", "compute_per_step_s")
    result = {k: getattr(summary, k) for k in keep}
    if kill_at_step is not None:
        result["killed_at_step"] = killed
        result["restarts"] = {f"{s.name}-{s.replica}": s.restarts for s in read_services(run_dir)}
        log = (run_dir / "logs" / "nn_worker-0.log").read_text()
        result["checkpoint_restored_at"] = [json.loads(line).get("step") for line in log.splitlines()
                                            if '"checkpoint_restored"' in line]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="directory with train.tsv, eval.tsv, oracle.json")
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic rows when --data is not given")
    parser.add_argument("--nn-workers", type=int, help="NN workers (default: one per GPU, at most 2)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kill", action="store_true", help="also an NN-worker kill run on NCCL")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA build of torch and a GPU")
    gpus = torch.cuda.device_count()
    nn_workers = args.nn_workers or min(2, gpus)
    work = Path(tempfile.mkdtemp(prefix="hybridrec-gpu-"))
    data = args.data
    if data is None:
        data = work / "data"
        subprocess.run([sys.executable, "-m", "hybridrec", "data", "synth", "--out", str(data), "--rows",
                        str(args.rows)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    config = write_config(data, work / "config.yaml", nn_workers)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "nn_workers": nn_workers,
                    "torch": torch.__version__, "data": str(data)}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every run, so a run cut short by a lease still leaves what it measured
        args.out.write_text(json.dumps(result, indent=2))

    result["cpu"] = run(config, work / "cpu", ["training.backend=gloo"])
    save()
    runs: dict[str, list[dict]] = {"nccl_overlap": [], "nccl_sync_copies": []}
    result.update(runs)
    for repeat in range(args.repeats):
        for name, overlap in (("nccl_overlap", "true"), ("nccl_sync_copies", "false")):
            runs[name].append(run(config, work / f"{name}-{repeat}", ["training.backend=nccl",
                                                                         f"training.overlap_copies={overlap}"]))
            save()
        best = {name: max(r["samples_per_sec"] for r in rs) for name, rs in runs.items()}
        result["overlap_speedup"] = best["nccl_overlap"] / best["nccl_sync_copies"]
        result["auc_vs_cpu"] = {name: [r["auc"] - result["cpu"]["auc"] for r in rs] for name, rs in runs.items()}
        if args.kill and repeat == 0:  # before the second repeat: the kill matters more than a second timing
            steps = result["cpu"]["steps"]
            if nn_workers < 2:  # the only rank: replaced from the newest checkpoint (an interval short enough)
                result["kill"] = run(config, work / "kill", ["training.backend=nccl", "checkpoint.interval_s=2"],
                                     kill_at_step=int(steps * 0.3), kill_replica=0)
            else:
                result["kill"] = run(config, work / "kill", ["training.backend=nccl"], kill_at_step=int(steps * 0.3))
        save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
