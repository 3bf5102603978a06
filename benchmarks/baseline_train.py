"""What the single-process baselines (benchmarks/baselines.py) share besides data.

One training loop, one result record and one model head for both the PyTorch
and the TorchRec baseline, so that their numbers differ only in how the
embeddings are stored and updated: the same hybridrec ``DNN`` (hidden
512-256-128), the same initialisation and Adagrad eps as hybridrec's PS
defaults, the same clock (train wall time only; the evaluations for the
AUC-vs-time curve are excluded from it, as in hybridrec's own figure) and the
same metrics. It lives in its own module, not in baselines.py, because the
TorchRec baseline needs it too and baselines.py runs as ``__main__``: importing
it back from there would load a second copy of the script.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, ContextManager, Sequence

import numpy as np
import torch

from benchmarks.baseline_data import FEATURES, Tensors
from hybridrec.core.model.models import DNN, FeatureInfo
from services.dataloader.tsv import NUM_DENSE

INIT_SCALE = 0.01  # hybridrec's default ps.init: uniform(-0.01, 0.01)
ADAGRAD_EPS = 1e-10  # hybridrec's default optimizer.embedding.eps
EVAL_BATCH = 65536


@dataclass
class BaselineResult:
    name: str
    samples_per_sec: float
    auc: float
    logloss: float
    train_wall_s: float
    samples: int
    curve: list[tuple[float, float]] = field(default_factory=list)
    """(train wall seconds, eval AUC) after some steps; the last point is the final model."""
    steps: int = 0
    threads: int = 1
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["curve"] = [list(p) for p in self.curve]
        return d


def _metrics(labels: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    from sklearn.metrics import log_loss, roc_auc_score

    p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(roc_auc_score(labels, logits)), float(log_loss(labels, p, labels=[0, 1]))


@torch.no_grad()
def _evaluate(predict: Callable[[Tensors, int, int], torch.Tensor], data: Tensors) -> tuple[float, float]:
    out = [predict(data, lo, min(lo + EVAL_BATCH, len(data))).float().cpu().numpy()
           for lo in range(0, len(data), EVAL_BATCH)]
    return _metrics(data.labels.cpu().numpy(), np.concatenate(out))


def _curve_steps(total_steps: int, points: int) -> set[int]:
    """Steps (1-based, < total) after which to evaluate for the AUC-vs-time curve."""
    if points <= 0 or total_steps < 2:
        return set()
    return {max(1, round(total_steps * k / (points + 1))) for k in range(1, points + 1)} - {total_steps}


def no_sync() -> None:
    """On the CPU every step has finished when it returns: nothing to wait for before reading the clock."""


def _clock(sync: Callable[[], None]) -> tuple[float, float]:
    """(wall, CPU) clocks once the device has finished what was queued, so a GPU's queued steps are timed."""
    sync()
    return time.perf_counter(), time.process_time()


def _train_loop(name: str, step_fn: Callable[[Tensors, int, int], None],
                predict: Callable[[Tensors, int, int], torch.Tensor], train: Tensors, evals: Tensors, *,
                batch_size: int, epochs: int, max_steps: int | None, curve_points: int, threads: int,
                set_train: Callable[[bool], None], details: dict, sync: Callable[[], None] = no_sync,
                watch: ContextManager | None = None) -> BaselineResult:
    """Train for `total` steps and evaluate; `sync` waits for the device before each clock read, `watch`
    (a GPU utilisation sampler, say) is entered around the training loop only, the final evaluation left out
    (the curve's evaluations, when `curve_points` asks for them, fall inside it)."""
    n = len(train)
    steps_per_epoch = math.ceil(n / batch_size)
    total = steps_per_epoch * epochs if max_steps is None else min(max_steps, steps_per_epoch * epochs)
    evals_at = _curve_steps(total, curve_points)
    curve: list[tuple[float, float]] = []
    wall = cpu = 0.0
    samples = 0
    step = 0
    load_before = os.getloadavg()[0]
    set_train(True)
    with watch or contextlib.nullcontext():
        t0, c0 = _clock(sync)
        while step < total:
            lo = (step % steps_per_epoch) * batch_size
            hi = min(lo + batch_size, n)
            step_fn(train, lo, hi)
            samples += hi - lo
            step += 1
            if step in evals_at:
                t1, c1 = _clock(sync)
                wall, cpu = wall + t1 - t0, cpu + c1 - c0
                set_train(False)
                curve.append((wall, _evaluate(predict, evals)[0]))
                set_train(True)
                t0, c0 = _clock(sync)
        t1, c1 = _clock(sync)
        wall, cpu = wall + t1 - t0, cpu + c1 - c0
    # CPU seconds the process got while training: on a shared machine, wall time / CPU time shows
    # how much of the cores it actually had (2 threads on 2 free cores: cpu close to 2 x wall).
    details = {**details, "train_cpu_s": cpu, "loadavg_1m_before": load_before,
               "loadavg_1m_after": os.getloadavg()[0]}
    set_train(False)
    auc, logloss = _evaluate(predict, evals)
    curve.append((wall, auc))
    return BaselineResult(name=name, samples_per_sec=samples / wall if wall > 0 else 0.0, auc=auc,
                          logloss=logloss, train_wall_s=wall, samples=samples, curve=curve, steps=step,
                          threads=threads, details=details)


def _dnn(dim: int, hidden: Sequence[int]) -> DNN:
    return DNN(features=[FeatureInfo(f, dim) for f in FEATURES], num_dense=NUM_DENSE, hidden=list(hidden))


def _check(batch_size: int, epochs: int, table_rows: int, dim: int, threads: int) -> None:
    if batch_size <= 0 or epochs <= 0 or table_rows <= 0 or dim <= 0 or threads <= 0:
        raise ValueError("batch_size, epochs, table_rows, dim and threads must be positive")
