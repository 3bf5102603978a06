"""GPU benchmark: the README example with its NN workers on GPUs over NCCL, against the same run on the CPU and
against single-process PyTorch on the same GPU. Writes JSON. Needs a CUDA build of torch and at least one GPU;
measures, in one invocation on one machine and one data set:

* `capture_check`: the captured step (`training.capture`, services/nn_worker/captured.py) against the eager
  one in this process, on one GPU: dense parameters after 20 steps of both (goal: within 1e-5), a batch with
  more rows than any before it, and each step's median time (`capture_check` below);
* `cpu`: the example with `training.backend=gloo` (the accuracy reference);
* `baselines.pytorch_gpu`: benchmarks/baselines.py's single-process PyTorch baseline (the same function as the
  CPU baseline, with `device="cuda"`) on GPU 0: 26 `nn.EmbeddingBag(mode="sum", sparse=True)` with
  `torch.optim.Adagrad`, hybridrec's DNN with the example's hidden sizes and Adam, the example's batch size,
  epochs and learning rates, all the data indexed on the GPU before the clock starts. samples/s is train samples /
  train wall time, the clock read after `torch.cuda.synchronize()`; eval AUC and log loss on the same eval file;
* `nccl_overlap` and `nccl_sync_copies`: NN workers on GPUs, with `training.overlap_copies` on and off, run
  alternately `--repeats` times; samples/s of each and their ratio (the overlap's gain), eval AUC of each and
  its difference from the CPU run's (the issue's bound: 0.005);
* `nccl_captured` and `nccl_captured_receiver`: the same with `training.capture` (and the receiver process);
  `capture_speedup` is the best captured run's samples/s over the best `nccl_overlap` run's. `--runs` picks
  which of the four run;
* with `--kill` and at least two GPUs: rank 1 SIGKILLed once rank 0 has trained 30% of its steps, on NCCL; the
  run must replace it (its peer hands over the dense state) and end with 0 skipped batches and 0 lost updates;
* with `--kill` and one GPU (one NN worker): that rank SIGKILLed after the first interval checkpoint, at 30% of
  its steps; nobody holds the dense state, so its replacement resumes on NCCL from the checkpoint the GPU
  wrote (the group-loss path, not the hand-over).

Every hybridrec run and the baseline also record `gpu_busy`: the GPUs' utilisation (NVML's utilization.gpu, the
share of the last sample period in which a kernel ran; through pynvml if it imports, else nvidia-smi) sampled
every 250 ms while it trains (a hybridrec run: between its phases first_step and end_of_training): `busy_share`,
the share of samples above 0, and `mean_utilization`; both null, with `reason`, where neither source answers.
Every hybridrec run records `accounting`: each service's core-seconds per 1M training samples over the same
phases (benchmarks/modes.py's table; the MLP's own CPU share is subtracted on the CPU run only: on a GPU the MLP
is not CPU work). `targets` records, and does not assert, the goals of feeding the GPU: the fastest NCCL run's
samples/s (goal >= 1,000,000), its ratio to `pytorch_gpu` (goal >= 4) and its AUC minus the CPU run's (goal:
within 0.002).

NN workers: one per GPU, at most the example's two (`--nn-workers` to choose). The data is --data DIR
(train.tsv, eval.tsv, oracle.json: the README's data/synth) or, without it, --rows synthetic rows written first.

    python benchmarks/gpu.py --rows 4000000 --out results/gpu.json          # throughput and the targets
    python benchmarks/gpu.py --rows 1000000 --kill --out results/gpu.json   # and a killed NN worker
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import yaml
from torch import distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.baselines import clear_cache, run_pytorch  # noqa: E402
from benchmarks.modes import accounting, mlp_core_s_per_1m  # noqa: E402
from hybridrec.app.run.launcher import rank_step  # noqa: E402
from hybridrec.core.config import from_dict  # noqa: E402
from hybridrec.core.model.models import FeatureInfo, build_model  # noqa: E402
from hybridrec.core.model.pooling import Pooler  # noqa: E402
from hybridrec.core.model.tasks import Tasks  # noqa: E402
from hybridrec.core.wire.compress import ValueCodec  # noqa: E402
from hybridrec.core.wire.frames import DenseBatch, Embeddings  # noqa: E402
from hybridrec.core.wire.jagged import KeyedBags  # noqa: E402
from services.nn_worker.captured import CapturedStep  # noqa: E402
from services.nn_worker.group.distributed import DenseSync, DistEnv, close_groups, open_groups  # noqa: E402
from services.nn_worker.step import StepMath, make_dense_optimizer  # noqa: E402
from hybridrec.core.layouts.summary import RunSummary, read_services  # noqa: E402

README_CONFIG = REPO / "examples" / "criteo_synth.yaml"
NCCL_RUNS = {
    "nccl_overlap": ["training.overlap_copies=true"],
    "nccl_sync_copies": ["training.overlap_copies=false"],
    "nccl_captured": ["training.capture=true"],
    "nccl_captured_receiver": ["training.capture=true", "training.receiver=true"],
}
"""The NN-worker runs on NCCL, each with its settings (`--runs` picks some)."""
SAMPLE_INTERVAL_S = 0.25
GOAL_SAMPLES_PER_SEC = 1_000_000
GOAL_VS_PYTORCH_GPU = 4.0
GOAL_AUC_DIFF = 0.002
KEEP = ("samples_per_sec", "auc", "logloss", "samples", "steps", "skipped_batches", "lost_updates",
        "train_wall_s", "exposed_wait_per_step_s", "compute_per_step_s")


# ------------------------------------------------------------------ GPU utilisation

Reader = Callable[[], list[int]]


def nvml_reader(gpus: Sequence[int]) -> Reader:
    """Utilisation of `gpus` (NVML indices) through pynvml: in-process, so sampling costs the GPU nothing."""
    import pynvml

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpus]
    return lambda: [int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles]


def smi_reader(gpus: Sequence[int]) -> Reader:
    """Utilisation of `gpus` through nvidia-smi, where pynvml is not installed (one process per sample)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise FileNotFoundError("nvidia-smi is not on PATH")
    cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"--id={','.join(map(str, gpus))}"]

    def read() -> list[int]:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
        if done.returncode != 0:
            raise RuntimeError(f"nvidia-smi exited {done.returncode}: {done.stderr.strip()[-300:]}")
        values = [int(v) for v in done.stdout.split()]
        if len(values) != len(gpus):
            raise ValueError(f"nvidia-smi gave {done.stdout.strip()!r} for GPUs {list(gpus)}")
        return values

    return read


def open_reader(gpus: Sequence[int]) -> tuple[Reader | None, str]:
    """The first source that reads `gpus` once, and its name; (None, why each failed) where none does."""
    failures = []
    for name, make in (("pynvml", nvml_reader), ("nvidia-smi", smi_reader)):
        try:
            read = make(gpus)
            read()
            return read, name
        except Exception as e:  # noqa: BLE001 -- whatever fails, the next source is tried and the reason kept
            failures.append(f"{name}: {type(e).__name__}: {e}")
    return None, "; ".join(failures)


def busy_summary(points: Sequence[tuple[float, Sequence[int]]], gpus: Sequence[int],
                 window: tuple[float, float] | None = None) -> dict:
    """Share of samples with utilisation above 0 and the mean utilisation (%), over the samples in `window`
    (Unix seconds; None: all), for all `gpus` together and for each."""
    kept = [values for t, values in points if window is None or window[0] <= t <= window[1]]
    per_gpu = {str(g): [v[i] for v in kept] for i, g in enumerate(gpus)}
    everything = [u for values in per_gpu.values() for u in values]

    def stats(values: list[int]) -> dict:
        if not values:
            return {"busy_share": None, "mean_utilization": None}
        return {"busy_share": round(sum(u > 0 for u in values) / len(values), 4),
                "mean_utilization": round(sum(values) / len(values), 2)}

    return {"samples": len(kept), **stats(everything), "per_gpu": {g: stats(v) for g, v in per_gpu.items()},
            "window": "training phase" if window else "while the sampler ran",
            "reason": None if kept else "no utilisation sample in the window"}


class GpuSampler:
    """Samples the GPUs' utilisation every `interval_s` in a background thread while it is entered.

    samples/s alone does not say whether the GPU waited on whoever feeds it; the share of samples in which a
    kernel ran does. The sampler never fails the benchmark: where no source answers it records why."""

    def __init__(self, gpus: Sequence[int], interval_s: float = SAMPLE_INTERVAL_S):
        self.gpus, self.interval_s = list(gpus), interval_s
        self.points: list[tuple[float, list[int]]] = []
        self.failed_reads = 0
        self.source: str | None = None
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuSampler":
        read, named = open_reader(self.gpus)
        if read is None:
            self.reason = named
            return self
        self.source = named
        self._thread = threading.Thread(target=self._loop, args=(read,), name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self, read: Reader) -> None:
        while not self._stop.is_set():
            started = time.time()
            try:
                self.points.append((started, read()))
            except Exception:  # noqa: BLE001 -- a missed sample is counted, not fatal
                self.failed_reads += 1
            self._stop.wait(max(0.0, self.interval_s - (time.time() - started)))

    def summary(self, window: tuple[float, float] | None = None) -> dict:
        """busy_summary of what was sampled, with where it came from; nulls and the reason if nothing was."""
        out = {"source": self.source, "interval_s": self.interval_s, "failed_reads": self.failed_reads,
               **busy_summary(self.points, self.gpus, window)}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


# ------------------------------------------------------------------ hybridrec runs

def example_config() -> dict:
    return yaml.safe_load(README_CONFIG.read_text())


def write_config(data: Path, out: Path, nn_workers: int) -> Path:
    tree = example_config()
    tree["data"] = {"train": [str(data / "train.tsv")], "eval": [str(data / "eval.tsv")],
                    "oracle": str(data / "oracle.json")}
    tree.setdefault("cluster", {})["nn_workers"] = ["127.0.0.1:0"] * nn_workers
    out.write_text(yaml.safe_dump(tree))
    return out


def checkpointed(run_dir: Path) -> bool:
    """Whether the run has a complete interval checkpoint (renamed into place, no longer .tmp)."""
    return any(not m.parent.name.endswith(".tmp") for m in (run_dir / "checkpoints").glob("step-*/manifest.json"))


def kill_when(proc: subprocess.Popen, run_dir: Path, kill_at_step: int, kill_replica: int) -> int | None:
    """SIGKILL NN worker `kill_replica` once rank 0 is at `kill_at_step` (rank 0: once a checkpoint exists too,
    so its replacement has one to resume from); the step it was killed at, None if the run ended first."""
    import psutil

    pattern = f"serve nn_worker --config {run_dir / 'config.yaml'} --replica {kill_replica}"
    while proc.poll() is None:
        step = rank_step(run_dir)
        if step is not None and step >= kill_at_step and (kill_replica != 0 or checkpointed(run_dir)):
            for p in psutil.process_iter(["cmdline"]):
                if pattern in " ".join(p.info["cmdline"] or []):
                    p.send_signal(signal.SIGKILL)
                    return step
        time.sleep(0.2)
    return None


def kill_record(run_dir: Path, killed: int | None) -> dict:
    log = (run_dir / "logs" / "nn_worker-0.log").read_text()
    return {"killed_at_step": killed,
            "restarts": {f"{s.name}-{s.replica}": s.restarts for s in read_services(run_dir)},
            "checkpoint_restored_at": [json.loads(line).get("step") for line in log.splitlines()
                                       if '"checkpoint_restored"' in line]}


def phase_window(series: dict) -> tuple[float, float] | None:
    """(first_step, end_of_training) in seconds since the launch, None if the run did not record both."""
    phases = series.get("phases") or {}
    t0, t1 = phases.get("first_step"), phases.get("end_of_training")
    return None if t0 is None or t1 is None else (float(t0), float(t1))


def training_window(series: dict) -> tuple[float, float] | None:
    """The training phase in Unix seconds, the GPU sampler's clock; None without a launch time or phases."""
    window, launched = phase_window(series), series.get("launched_at")
    return None if window is None or not launched else (launched + window[0], launched + window[1])


def run_accounting(series: dict, summary: RunSummary, on_cpu: bool) -> dict | None:
    """benchmarks/modes.py's accounting over the training phase; the MLP's CPU share only where it ran on it."""
    window = phase_window(series)
    if window is None:
        return None
    hidden = tuple(example_config()["model"]["kwargs"]["hidden"])
    mlp = mlp_core_s_per_1m(hidden) if on_cpu else 0.0
    return accounting(series["resources"], *window, summary.samples, mlp, summary.compute_cpu_s)


def run(config: Path, run_dir: Path, sets: list[str], gpus: int, kill_at_step: int | None = None,
        kill_replica: int = 1) -> dict:
    """One `hybridrec run` with GPUs 0..gpus-1 sampled while it runs; its summary, GPU busy share and accounting."""
    cmd = [sys.executable, "-m", "hybridrec", "run", str(config), "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    with GpuSampler(range(gpus)) as sampler:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        killed = None if kill_at_step is None else kill_when(proc, run_dir, kill_at_step, kill_replica)
        _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"hybridrec run {' '.join(sets)} failed ({proc.returncode}):\n{err[-3000:]}")
    summary = RunSummary.of_run(run_dir)
    series = json.loads((run_dir / "series.json").read_text())
    result = {k: getattr(summary, k) for k in KEEP}
    result["gpu_busy"] = sampler.summary(training_window(series))
    result["accounting"] = run_accounting(series, summary, on_cpu="training.backend=gloo" in sets)
    if kill_at_step is not None:
        result |= kill_record(run_dir, killed)
    return result


# ------------------------------------------------------------------ single-process PyTorch on the GPU

def baseline_kwargs(tree: dict) -> dict:
    """run_pytorch's settings from the README example, so the baseline trains what the hybridrec runs train."""
    opt, training = tree["optimizer"], tree["training"]
    if (opt["embedding"]["name"], opt["dense"]["name"]) != ("adagrad", "adam"):
        raise SystemExit(f"the PyTorch baseline trains Adagrad + Adam; {README_CONFIG} has {opt}")
    return {"hidden": tuple(tree["model"]["kwargs"]["hidden"]), "batch_size": training["batch_size"],
            "epochs": training.get("epochs", 1), "lr_emb": opt["embedding"]["lr"], "lr_dense": opt["dense"]["lr"]}


def pytorch_gpu(data: Path, device: str = "cuda", **overrides: object) -> dict:
    """benchmarks/baselines.py's run_pytorch on `device` with the README example's settings (`overrides` on top:
    the unit test's small tables), GPU 0 sampled while it trains; no curve, so nothing but training is sampled."""
    kwargs = {**baseline_kwargs(example_config()), "curve_points": 0, **overrides}
    sampler = GpuSampler([0])
    try:
        res = run_pytorch([str(data / "train.tsv")], [str(data / "eval.tsv")], device=device, watch=sampler,
                          **kwargs)
    finally:
        clear_cache()  # the host copy of the data; the GPU's went with the function's tensors
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # leave the GPU's memory to the hybridrec runs that follow
    return {"samples_per_sec": res.samples_per_sec, "auc": res.auc, "logloss": res.logloss,
            "train_wall_s": res.train_wall_s, "samples": res.samples, "steps": res.steps,
            "gpu_busy": sampler.summary(), "details": res.details}


# ------------------------------------------------------------------ the captured step against the eager one

def capture_check(device: str = "cuda", steps: int = 20, timed: int = 30, batch_size: int | None = None,
                  seed: int = 0) -> dict:
    """The captured step (services/nn_worker/captured.py) against the eager one, in this process on one rank:
    the README model, features and batch size; the same initial model on both sides; synthetic batches whose
    unique rows per feature vary (so they fall into a few buckets), the last one holding more rows than any
    before it (a bucket of its own). Records:

    * `params_max_diff`: the largest difference of a dense parameter after `steps` steps of both (goal 1e-5),
      and `grads_max_diff`, of the embedding gradients over the steps (fp16-packed: their units are kappa's);
    * `eager_step_ms` and `captured_step_ms`: the median wall time of `timed` more steps of each, the device
      synchronised around each (what a step costs the host and the device together);
    * `buckets` (captured graphs), `refused` (why the step was not captured, or null).

    On a CPU (`device="cpu"`, the unit test) the padded step runs without a graph."""
    tree = example_config()
    tree["training"]["capture"] = True
    tree["data"] = {"train": ["unused"]}
    if batch_size is not None:
        tree["training"]["batch_size"] = batch_size
    config = from_dict(tree)
    size = config.training.batch_size
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        timeout = datetime.timedelta(seconds=120)
        open_groups(backend, dist.FileStore(str(Path(tmp) / "store"), 1), rank=0, world_size=1,
                    device=torch.device(device), dense_timeout=timeout, control_timeout=timeout)
        try:
            torch.manual_seed(seed)
            model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features],
                                config.num_dense, config.model.kwargs)
            env = DistEnv(rank=0, world_size=1, backend=backend, device=torch.device(device))
            values = ValueCodec(fp16=config.training.compression.fp16, kappa=config.training.compression.kappa)
            sides = []
            for replica in (model, copy.deepcopy(model)):
                math = StepMath(replica, env, config.training, Tasks.from_config(config),
                                Pooler(config.features, values))
                math.optimizer = make_dense_optimizer(math.model, config)
                math.sync = DenseSync(math.model, env, config.training)
                sides.append(math)
            eager, captured = sides
            eager.captured = None
            if captured.captured is None:
                captured.captured = CapturedStep(captured, graphs=device == "cuda")
            return _compare(eager, captured, config, values, size, steps, timed, np.random.default_rng(seed))
        finally:
            close_groups()
            if device == "cuda":
                torch.cuda.empty_cache()


def _compare(eager, captured, config, values, size: int, steps: int, timed: int, rng) -> dict:
    grads_diff, losses = 0.0, []
    for number in range(1, steps + 1):
        batch, frame = synthetic_batch(rng, config, values, size, more_rows=number == steps)
        outs = [_step(math, batch, frame, number) for math in (eager, captured)]
        losses.append([out.loss() for out in outs])
        for key, want in outs[0].packed().items():
            got = outs[1].packed()[key]
            if got.shape != want.shape:
                raise SystemExit(f"captured step: {key} has {got.shape}, the eager step {want.shape}")
            grads_diff = max(grads_diff, float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max()))
    params_diff = max(float((a - b).detach().abs().max()) for a, b in zip(eager.model.parameters(),
                                                                     captured.model.parameters()))
    times = {}
    for name, math in (("eager", eager), ("captured", captured)):
        spent = []
        for number in range(steps + 1, steps + 1 + timed):
            batch, frame = synthetic_batch(rng, config, values, size)
            emb = math.pooler.decode(frame, size)
            _synchronize(math)
            started = time.perf_counter()
            out = math.train(batch, emb, step=number)
            if out.event is not None:
                out.event.synchronize()
            _synchronize(math)
            spent.append(time.perf_counter() - started)
        times[f"{name}_step_ms"] = 1000 * float(np.median(spent))
    step = captured.captured
    return {"steps": steps, "batch_size": size, "params_max_diff": params_diff, "grads_max_diff": grads_diff,
            "losses_first_last": [losses[0], losses[-1]], **times,
            "buckets": sum(1 for g in step.buckets.values() if g.graph is not None) if step.graphs
            else len(step.buckets), "refused": step.refusal()}


def _step(math, batch, frame: bytes, number: int):
    out = math.train(batch, math.pooler.decode(frame, batch.labels.shape[0]), step=number)
    if out.event is not None:
        out.event.synchronize()
    return out


def _synchronize(math) -> None:
    if math.env.device.type == "cuda":
        torch.cuda.synchronize(math.env.device)


def synthetic_batch(rng, config, values, size: int, more_rows: bool = False) -> tuple:
    """A README-like batch: every feature present in about 95% of the samples, its unique rows a random share
    of them (more with `more_rows`), as the embedding worker would send them (an `Embeddings` frame)."""
    lengths = (rng.random((len(config.features), size)) < 0.95).astype(np.uint16)
    pos, counts = [], []
    for present in lengths.sum(axis=1):
        low, high = (present // 2, present) if more_rows else (present // 8, present // 3)
        unique = int(rng.integers(max(low, 1), max(high, 2)))
        drawn = rng.integers(0, unique, int(present))
        drawn[:min(unique, int(present))] = np.arange(min(unique, int(present)))
        pos.append(drawn)
        counts.append(min(unique, int(present)))
    rows = {}
    for dim in sorted({f.dim for f in config.features}):
        total = sum(c for c, f in zip(counts, config.features) if f.dim == dim)
        rows[dim] = (0.01 * rng.standard_normal((total, dim))).astype(np.float32)
    frame = Embeddings(KeyedBags(np.concatenate(pos).astype(np.uint16), lengths), np.array(counts, np.int32),
                       rows).encode(values)
    batch = DenseBatch(1, rng.standard_normal((size, config.num_dense)).astype(np.float32),
                       rng.integers(0, 2, size).astype(np.float32))
    return batch, frame


# ------------------------------------------------------------------ targets and the command line

def goal(value: float | None, met: Callable[[float], bool], text: str) -> dict:
    return {"value": value, "goal": text, "met": None if value is None else bool(met(value))}


def targets(result: dict) -> dict:
    """The goals of feeding the GPU against the fastest NCCL run so far: recorded, not asserted, so a run that
    misses them still leaves every figure it measured."""
    runs = [(f"{name}-{i}", r) for name in NCCL_RUNS for i, r in enumerate(result.get(name, []))]
    if not runs:
        return {}
    name, best = max(runs, key=lambda item: item[1]["samples_per_sec"])
    base = result.get("baselines", {}).get("pytorch_gpu")
    ratio = best["samples_per_sec"] / base["samples_per_sec"] if base and base["samples_per_sec"] else None
    cpu = result.get("cpu")
    auc_diff = best["auc"] - cpu["auc"] if cpu and best["auc"] is not None and cpu["auc"] is not None else None
    return {"hybrid_run": name,
            "hybrid_samples_per_sec": goal(best["samples_per_sec"], lambda v: v >= GOAL_SAMPLES_PER_SEC,
                                           f">= {GOAL_SAMPLES_PER_SEC:,}"),
            "hybrid_vs_pytorch_gpu": goal(ratio, lambda v: v >= GOAL_VS_PYTORCH_GPU, f">= {GOAL_VS_PYTORCH_GPU:g}"),
            "hybrid_minus_cpu_auc": goal(auc_diff, lambda v: abs(v) <= GOAL_AUC_DIFF, f"|value| <= {GOAL_AUC_DIFF}")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="directory with train.tsv, eval.tsv, oracle.json")
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic rows when --data is not given")
    parser.add_argument("--nn-workers", type=int, help="NN workers (default: one per GPU, at most 2)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kill", action="store_true", help="also an NN-worker kill run on NCCL")
    parser.add_argument("--runs", nargs="+", choices=list(NCCL_RUNS), default=list(NCCL_RUNS),
                        help="which NCCL runs (default: all)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def synthesize(out: Path, rows: int) -> Path:
    subprocess.run([sys.executable, "-m", "hybridrec", "data", "synth", "--out", str(out), "--rows", str(rows)],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out


def kill_run(config: Path, work: Path, steps: int, nn_workers: int) -> dict:
    if nn_workers < 2:  # the only rank: replaced from the newest checkpoint (an interval short enough)
        return run(config, work / "kill", ["training.backend=nccl", "checkpoint.interval_s=2"], nn_workers,
                   kill_at_step=int(steps * 0.3), kill_replica=0)
    return run(config, work / "kill", ["training.backend=nccl"], nn_workers, kill_at_step=int(steps * 0.3))


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA build of torch and a GPU")
    gpus = torch.cuda.device_count()
    nn_workers = args.nn_workers or min(2, gpus)
    work = Path(tempfile.mkdtemp(prefix="hybridrec-gpu-"))
    data = args.data or synthesize(work / "data", args.rows)
    config = write_config(data, work / "config.yaml", nn_workers)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "nn_workers": nn_workers,
                    "torch": torch.__version__, "data": str(data)}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every run, so a run cut short by a lease still leaves what it measured
        result["targets"] = targets(result)
        args.out.write_text(json.dumps(result, indent=2))

    result["capture_check"] = capture_check()
    save()
    result["cpu"] = run(config, work / "cpu", ["training.backend=gloo"], nn_workers)
    save()
    result["baselines"] = {"pytorch_gpu": pytorch_gpu(data)}
    save()
    runs: dict[str, list[dict]] = {name: [] for name in args.runs}
    result.update(runs)
    for repeat in range(args.repeats):
        for name in args.runs:
            runs[name].append(run(config, work / f"{name}-{repeat}", ["training.backend=nccl", *NCCL_RUNS[name]],
                                  nn_workers))
            save()
        best = {name: max(r["samples_per_sec"] for r in rs) for name, rs in runs.items()}
        if "nccl_overlap" in best and "nccl_sync_copies" in best:
            result["overlap_speedup"] = best["nccl_overlap"] / best["nccl_sync_copies"]
        if "nccl_overlap" in best and "nccl_captured" in best:
            result["capture_speedup"] = best["nccl_captured"] / best["nccl_overlap"]
        result["auc_vs_cpu"] = {name: [r["auc"] - result["cpu"]["auc"] for r in rs] for name, rs in runs.items()}
        if args.kill and repeat == 0:  # before the second repeat: the kill matters more than a second timing
            result["kill"] = kill_run(config, work, result["cpu"]["steps"], nn_workers)
        save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
