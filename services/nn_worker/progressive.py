"""Progressive validation over a sliding window: each training sample's prediction is taken before the step
that trains on it, so the predictions of the last N samples score the model on data it had not seen, as it
went. It is the standard metric of online training, where no held-out file keeps up with the stream.

Each rank keeps the last `training.progressive_window / world size` samples of its own batches (the first
task's). Its status reports the window's AUC (every fifth step); at the end of training rank 0 gathers every
rank's window into the run's `progressive_auc`.
"""
from __future__ import annotations

import numpy as np

from hybridrec.evaluation import binary_metrics


class ProgressiveWindow:
    """The last `size` (prediction, label) pairs, in a ring."""

    def __init__(self, size: int):
        self.probs = np.zeros(size, np.float32)
        self.labels = np.zeros(size, np.float32)
        self.seen = 0

    def add(self, probs: np.ndarray, labels: np.ndarray) -> None:
        size, total = self.probs.shape[0], probs.shape[0]
        n = min(total, size)  # of more than the window, the last `size`, where they would have gone
        probs, labels = probs[total - n:], labels[total - n:]
        at = (self.seen + total - n) % size
        first = min(n, size - at)
        self.probs[at:at + first], self.labels[at:at + first] = probs[:first], labels[:first]
        self.probs[:n - first], self.labels[:n - first] = probs[first:], labels[first:]
        self.seen += total

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(predictions, labels) of the window, oldest first (copies)."""
        size = self.probs.shape[0]
        if self.seen <= size:
            return self.probs[:self.seen].copy(), self.labels[:self.seen].copy()
        at = self.seen % size
        return np.roll(self.probs, -at), np.roll(self.labels, -at)

    def auc(self) -> float:
        probs, labels = self.arrays()
        auc = binary_metrics(labels, probs)["auc"] if probs.size else None
        return float("nan") if auc is None else float(auc)
