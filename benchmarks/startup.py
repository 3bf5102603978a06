"""Start-up benchmark: seconds from `hybridrec run CONFIG` to the first training step. Writes JSON.

Runs the README example (examples/criteo_synth.yaml: two PS shards, an embedding worker, two NN workers and
the data loader, six processes) twice on one numba cache directory:

* cold: an empty NUMBA_CACHE_DIR, so every compiled kernel is compiled in the services' start-up;
* warm: the cache the cold run left, as on every run after the first.

With `--cache DIR` every run uses DIR instead (the first is cold only if DIR is empty): a cache another checkout
filled shows that a second checkout of the same code starts warm (`hybridrec/core/runtime/kernel_cache.py`).

The operating system's file cache is warm in both (the Python packages were read before). For each run it
reports `first_step_s`, from starting the command to the first training step of any NN worker (the summary's
`train_started_at`: the moment a rank has its first batch's embeddings and starts computing), the launcher's
own `phases.first_step` (from its launch, after the `hybridrec run` process's own imports), and per service
when it logged `listening`, `warmed_up` (a PS) and `serving`, and when each fork server parent had imported
what its services import (`preloaded base`, `preloaded dense`) and the light one the PS kernels (`preloaded ps
kernels`), in seconds from the command's start: where the time goes.

Each run stops after --steps training steps per NN worker and evaluates --eval-rows held-out rows, so a run
lasts a few seconds beyond its start-up. The data is --data DIR (train.tsv, eval.tsv; the README's
data/synth when it exists) or, without it, --rows synthetic rows written first.

    python benchmarks/startup.py --out results/startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hybridrec.core.runtime.log import timestamp_of  # noqa: E402
from hybridrec.core.layouts.summary import RunSummary  # noqa: E402

README_CONFIG = REPO / "examples" / "criteo_synth.yaml"
README_DATA = REPO / "data" / "synth"


def synthesize(out: Path, rows: int) -> Path:
    """A small Criteo-format data set (train.tsv, eval.tsv) under `out`."""
    subprocess.run([sys.executable, "-m", "hybridrec", "data", "synth", "--out", str(out), "--rows", str(rows),
                    "--eval-rows", str(max(rows // 10, 1000))], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out


def head(src: Path, dst: Path, lines: int) -> Path:
    """The first `lines` lines of `src` (a held-out set small enough that evaluation ends the run quickly)."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        for _, line in zip(range(lines), f):
            out.write(line)
    return dst


def log_events(path: Path, events: tuple[str, ...] = ("listening", "warmed_up", "serving")) -> dict[str, float]:
    """Unix time of the first line of each of `events` in a service's JSON log (a PS's `warmed_up`: its kernels
    compiled or loaded), and of each of a fork server parent's `preloaded` lines, as `preloaded <what>`: its
    imports (base, dense) and, in the light parent, the PS kernels compiled before the first PS is forked."""
    found: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        event = entry.get("event")
        if event == "preloaded" and "at" in entry:
            found.setdefault(f"preloaded {entry.get('what')}", float(entry["at"]))
        elif event in events and event not in found and "timestamp" in entry:
            found[event] = timestamp_of(entry)
    return found


def run_once(config: Path, run_dir: Path, cache_dir: Path, overrides: list[str]) -> dict:
    """One `hybridrec run`; start-up figures from its summary and logs, in seconds from the command's start."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "hybridrec", "run", str(config), "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"hybridrec run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = RunSummary.of_run(run_dir)
    services = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        services[log.stem] = {event: round(t - started, 3) for event, t in log_events(log).items()}
    return {"first_step_s": round(summary.train_started_at - started, 3),
            "launcher_first_step_s": summary.phases.first_step, "wall_s": round(wall, 3),
            "steps": summary.steps, "services": services}


RECOVERY_TARGETS = {"embedding_ps": 1, "embedding_worker": 0, "nn_worker": 1, "dataloader": 0}
"""The replica of each kind the recovery runs kill (an NN worker other than rank 0, whose steps are watched)."""


def at_work_after(log: Path, after: float) -> float | None:
    """Unix time of the first `at_work` line of `log` stamped after `after` (a replacement's first work)."""
    for line in log.read_text(errors="replace").splitlines():
        if '"at_work"' not in line:
            continue
        try:
            at = timestamp_of(json.loads(line))
        except (ValueError, KeyError):
            continue
        if at > after:
            return at
    return None


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise SystemExit(f"the run ended while waiting for {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def recovery_run(config: Path, run_dir: Path, cache_dir: Path, overrides: list[str], kind: str, kills: int,
                 gap_steps: int) -> dict:
    """One `hybridrec run` in which replica RECOVERY_TARGETS[kind] of `kind` is SIGKILLed `kills` times, each
    time `gap_steps` steps of NN rank 0 after the last replacement was at work: seconds from each kill to the
    replacement's first piece of work (its `at_work` line), and what the run lost."""
    from hybridrec.app.run.launcher import rank_step
    from hybridrec.core.layouts.summary import read_services

    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "hybridrec", "run", str(config), "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    name = f"{kind}-{RECOVERY_TARGETS[kind]}"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = []
    try:
        step = wait_for(lambda: (rank_step(run_dir) or 0) >= gap_steps and rank_step(run_dir), "training", proc)
        for _ in range(kills):
            (target,) = [s for s in read_services(run_dir) if f"{s.name}-{s.replica}" == name]
            killed_at = time.time()
            os.kill(target.pid, signal.SIGKILL)
            back = wait_for(lambda: at_work_after(run_dir / "logs" / f"{name}.log", killed_at),
                            f"{name} to be at work again", proc)
            seconds.append(round(back - killed_at, 3))
            step = wait_for(lambda: (s := rank_step(run_dir)) is not None and s >= step + gap_steps and s,
                            f"{gap_steps} more steps", proc)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(f"hybridrec run failed ({proc.returncode}):\n{err[-3000:]}")
    summary = RunSummary.of_run(run_dir)
    return {"kind": kind, "replica": RECOVERY_TARGETS[kind], "seconds": seconds,
            "median_s": statistics.median(seconds), "launcher_recoveries": [r.model_dump() for r in
                                                                            summary.recoveries or []],
            "skipped_batches": summary.skipped_batches, "lost_updates": summary.lost_updates, "auc": summary.auc,
            "samples": summary.samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=README_CONFIG)
    parser.add_argument("--data", type=Path, default=README_DATA if (README_DATA / "train.tsv").exists() else None,
                        help="a directory with train.tsv and eval.tsv (default: data/synth when it exists)")
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic training rows when there is no --data")
    parser.add_argument("--steps", type=int, default=20, help="training steps per NN worker of each run")
    parser.add_argument("--eval-rows", type=int, default=20_000)
    parser.add_argument("--cache", type=Path, default=None,
                        help="the kernel cache directory (NUMBA_CACHE_DIR) of every run; default: an empty one, so "
                             "the first run is cold. Another checkout's cache shows what a second checkout of the "
                             "same code starts with")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm runs after the cold one")
    parser.add_argument("--recovery-kills", type=int, default=3,
                        help="kills of each service kind in the recovery runs (0: no recovery runs)")
    parser.add_argument("--recovery-gap", type=int, default=8, help="steps of NN rank 0 between two kills")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridrec-startup-") as scratch:
        scratch = Path(scratch)
        data = args.data or synthesize(scratch / "data", args.rows)
        eval_file = head(data / "eval.tsv", scratch / "eval.tsv", args.eval_rows)
        overrides = [f"data.train=[{data / 'train.tsv'}]", f"data.eval=[{eval_file}]", "data.oracle=null",
                     f"training.max_steps={args.steps}"]
        cache = args.cache or scratch / "numba-cache"
        cache.mkdir(parents=True, exist_ok=True)
        runs = [run_once(args.config, scratch / "run-cold", cache, overrides)]
        for i in range(args.warm_runs):
            runs.append(run_once(args.config, scratch / f"run-warm-{i}", cache, overrides))
        full = [f"data.train=[{data / 'train.tsv'}]", f"data.eval=[{eval_file}]", "data.oracle=null"]
        recoveries = [recovery_run(args.config, scratch / f"run-recovery-{kind}", cache, full, kind,
                                   args.recovery_kills, args.recovery_gap)
                      for kind in (RECOVERY_TARGETS if args.recovery_kills else ())]
    warm = runs[1:]
    result = {"benchmark": "startup", "config": str(args.config), "data": str(args.data or f"synthetic {args.rows} rows"),
              "cpus": os.cpu_count(), "cold": runs[0], "warm": warm,
              "cold_first_step_s": runs[0]["first_step_s"],
              "warm_first_step_s": min(r["first_step_s"] for r in warm) if warm else None,
              "recovery": recoveries,
              "recovery_median_s": {r["kind"]: r["median_s"] for r in recoveries}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))}, indent=2))


if __name__ == "__main__":
    main()
