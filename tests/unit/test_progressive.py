"""The progressive-validation window (services/nn_worker/progressive.py): the last N samples, oldest first."""
from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score

from services.nn_worker.progressive import ProgressiveWindow


def test_the_window_keeps_the_last_samples_in_order_across_wraps():
    window = ProgressiveWindow(10)
    assert window.arrays()[0].size == 0 and np.isnan(window.auc())
    window.add(np.arange(4, dtype=np.float32), np.zeros(4, np.float32))
    assert window.arrays()[0].tolist() == [0, 1, 2, 3]
    window.add(np.arange(4, 12, dtype=np.float32), np.ones(8, np.float32))  # wraps
    probs, labels = window.arrays()
    assert probs.tolist() == list(range(2, 12)) and labels.tolist() == [0, 0] + [1] * 8
    window.add(np.arange(100, 125, dtype=np.float32), np.zeros(25, np.float32))  # more than the window at once
    assert window.arrays()[0].tolist() == list(range(115, 125)) and window.seen == 37


def test_its_auc_is_the_auc_of_the_window_only():
    rng = np.random.default_rng(0)
    window = ProgressiveWindow(1000)
    old = rng.random(5000).astype(np.float32)
    window.add(old, (old > 0.5).astype(np.float32))  # perfectly ranked, then pushed out
    probs, labels = rng.random(1000).astype(np.float32), rng.integers(0, 2, 1000).astype(np.float32)
    for lo in range(0, 1000, 300):
        window.add(probs[lo:lo + 300], labels[lo:lo + 300])
    assert abs(window.auc() - roc_auc_score(labels, probs)) < 1e-9
