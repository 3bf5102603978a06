"""Progressive validation over a sliding window: each training sample's prediction is taken before the step
that trains on it, so the predictions of the last N samples score the model on data it had not seen, as it
went. It is the standard metric of online training, where no held-out file keeps up with the stream.

Each rank keeps the last `training.progressive_window / world size` samples of its own batches, every task.
The window is kept as a histogram, not as scores to sort: each prediction's logit falls in one of `BUCKETS`
equal buckets over [-LOGIT_RANGE, LOGIT_RANGE] (clamped), and the window holds, per task, the count of positive
and negative samples in each bucket. A step costs O(batch): each sample's bucket code and logit written into
the ring in one compiled pass (`_add_samples`), sequential writes only. The histogram is counted from the ring
when someone asks (the progress line, the metrics, the summary: O(window + buckets)), never on the step's path.
Every rank's histograms add up to the run's window (`window_metrics` of their sum).

**Error bound.** The bucketing is monotone, so a (positive, negative) pair in different buckets is ordered as
its scores are; a pair in one bucket counts as a tie (1/2), where its exact value is 0, 1/2 or 1. Hence

    |AUC(histogram) - AUC(exact)| <= 1/2 * sum_b pos_b * neg_b / (P * N)

which the window computes with the AUC (`WindowMetrics.auc_bound`). With 65,536 buckets (logit width
0.00049) and a CTR window of 100,000 samples it is below 1e-4 (6e-5 on a synthetic CTR window, where the
estimate was 2e-7 from the exact AUC)
(tests/unit/test_progressive.py checks both against scikit-learn's roc_auc_score). The log loss is exact:
each sample's logit is kept in the ring beside its bucket, and the window's loss (each probability clipped
to [1e-7, 1 - 1e-7], as `hybridrec.core.model.evaluation` does) is summed from them when asked, O(window) in a few
vectorised numpy passes, so the step pays no logarithm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hybridrec.core.model.evaluation import EPS
from hybridrec.core.runtime.kernel_cache import njit

BUCKETS = 1 << 16
LOGIT_RANGE = 16.0
"""Logits beyond +-16 (probabilities within 1.1e-7 of 0 or 1) share the end buckets."""
_LOGIT_CLIP = math.log((1 - EPS) / EPS)  # the log loss's clip: probabilities in [EPS, 1 - EPS]


@dataclass(frozen=True)
class WindowMetrics:
    auc: float  # nan when the window holds one class only (or nothing)
    auc_bound: float  # the largest |auc - exact AUC| the bucketing allows (module docstring)
    logloss: float
    samples: int


def bucket_of(logits: np.ndarray) -> np.ndarray:
    """int64 bucket of each logit: monotone in the logit, `BUCKETS` equal steps over +-LOGIT_RANGE."""
    scaled = (np.asarray(logits, np.float64) + LOGIT_RANGE) * (BUCKETS / (2 * LOGIT_RANGE))
    return np.clip(scaled, 0, BUCKETS - 1).astype(np.int64)


def sample_loss(logits: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """Each sample's log loss from its logit (stable: log(1 + e^-z) for a positive, log(1 + e^z) for a negative)."""
    z = np.clip(np.asarray(logits, np.float64), -_LOGIT_CLIP, _LOGIT_CLIP)
    t = np.where(positive, -z, z)
    return np.maximum(t, 0.0) + np.log1p(np.exp(-np.abs(t)))


def window_metrics(counts: np.ndarray, loss_sum: float) -> WindowMetrics:
    """AUC, its bound and the mean log loss of one task's histogram: `counts` (2, BUCKETS), row 0 the negatives
    per bucket, row 1 the positives; `loss_sum` the samples' summed log loss."""
    neg, pos = counts[0].astype(np.float64), counts[1].astype(np.float64)
    n_neg, n_pos = neg.sum(), pos.sum()
    samples = int(n_neg + n_pos)
    logloss = loss_sum / samples if samples else float("nan")
    if n_neg == 0 or n_pos == 0:
        return WindowMetrics(float("nan"), float("nan"), logloss, samples)
    below = np.cumsum(neg) - neg  # negatives in lower buckets
    pairs = n_pos * n_neg
    auc = float((pos @ below + 0.5 * (pos @ neg)) / pairs)
    return WindowMetrics(auc, float(0.5 * (pos @ neg) / pairs), logloss, samples)


class ProgressiveWindow:
    """The last `size` samples' (bucket, label, logit) of every task, in a ring; their histogram when asked."""

    def __init__(self, size: int, tasks: int = 1):
        self.size, self.tasks = size, tasks
        self.codes = np.zeros((tasks, size), np.int64)  # bucket * 2 + label
        self.logits = np.zeros((tasks, size), np.float32)
        self.seen = 0

    def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """A step's logits and labels, (n,) or (n, tasks), predicted before the step trained on them."""
        total = logits.shape[0]
        n = min(total, self.size)  # of more than the window, the last `size`, where they would have gone
        logits = np.ascontiguousarray(np.asarray(logits).reshape(total, -1)[total - n:, :self.tasks], np.float32)
        labels = np.ascontiguousarray(np.asarray(labels).reshape(total, -1)[total - n:, :self.tasks], np.float32)
        _add_samples(self.codes, self.logits, logits, labels, (self.seen + total - n) % self.size)
        self.seen += total

    @property
    def samples(self) -> int:
        return min(self.seen, self.size)

    def task_counts(self, task: int) -> np.ndarray:
        """int64 (2 * BUCKETS,): one task's histogram, index bucket * 2 + label. Counted when asked, O(window):
        a histogram kept up to date by every step cost the step 0.15-0.2 ms, its random accesses to a 1 MB
        array missing a cache the compute thread's pooling had just flushed."""
        return np.bincount(self.codes[task, :self.samples], minlength=2 * BUCKETS)

    @property
    def counts(self) -> np.ndarray:
        """int64 (tasks, 2 * BUCKETS): every task's histogram (`task_counts`)."""
        return np.stack([self.task_counts(t) for t in range(self.tasks)])

    def loss_sums(self) -> np.ndarray:
        """float64 (tasks,): the window's summed log loss per task."""
        return np.array([self.loss_sum(t) for t in range(self.tasks)], np.float64)

    def loss_sum(self, task: int) -> float:
        held = self.samples
        return float(sample_loss(self.logits[task, :held], (self.codes[task, :held] & 1) == 1).sum())

    def metrics(self, task: int = 0) -> WindowMetrics:
        return window_metrics(self.task_counts(task).reshape(BUCKETS, 2).T, self.loss_sum(task))

    def auc(self, task: int = 0) -> float:
        """`metrics(task).auc` alone: the histogram without the log loss's O(window) logarithms."""
        return window_metrics(self.task_counts(task).reshape(BUCKETS, 2).T, float("nan")).auc


@njit(cache=True, nogil=True)
def _add_samples(codes, ring_logits, logits, labels, first):
    """Samples i = 0..n-1 of (n, tasks) `logits` and `labels` into ring slots (first + i) % size of every task:
    each slot takes its sample's code (bucket * 2 + label, the bucket as `bucket_of`) and logit: sequential
    writes, no histogram (`ProgressiveWindow.task_counts`). A NaN logit falls in bucket 0, where the array
    version's cast put it."""
    size = codes.shape[1]
    scale = BUCKETS / (2 * LOGIT_RANGE)
    for t in range(logits.shape[1]):
        for i in range(logits.shape[0]):
            slot = (first + i) % size
            x = np.float64(logits[i, t])
            scaled = (x + LOGIT_RANGE) * scale
            bucket = 0
            if scaled >= BUCKETS - 1:
                bucket = BUCKETS - 1
            elif scaled > 0:
                bucket = int(scaled)
            positive = labels[i, t] > 0.5
            codes[t, slot] = bucket * 2 + (1 if positive else 0)
            ring_logits[t, slot] = logits[i, t]


def warm_up() -> None:
    """Load (or compile) the window's kernel: at the NN worker's start, not in its first step. Both signatures:
    a step's labels are a read-only view of the received frame (compiling that one took 0.3 s)."""
    window = ProgressiveWindow(4, 1)
    labels = np.ones(2, np.float32)
    window.add(np.zeros(2, np.float32), labels)
    labels.flags.writeable = False
    window.add(np.zeros(2, np.float32), labels)


def task_metrics(counts: np.ndarray, loss_sums: np.ndarray) -> list[WindowMetrics]:
    """Every task's metrics from (tasks, 2 * BUCKETS) counts and (tasks,) loss sums: one rank's window, or
    every rank's summed (services/nn_worker/results.py)."""
    return [window_metrics(c.reshape(BUCKETS, 2).T, float(s)) for c, s in zip(counts, loss_sums)]
