"""The progressive-validation window (services/nn_worker/progressive.py): a histogram of the last N samples'
logits whose AUC is within its stated bound of scikit-learn's on the same samples, and whose log loss is
scikit-learn's."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from hybridrec.core.model.evaluation import EPS
from services.nn_worker.progressive import (BUCKETS, LOGIT_RANGE, ProgressiveWindow, bucket_of, sample_loss,
                                           task_metrics, window_metrics)


def _ctr_batch(rng: np.random.Generator, n: int, spread: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a CTR model (mostly below 0) and labels drawn from them."""
    logits = (rng.normal(-1.2, spread, n)).astype(np.float32)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return logits, labels


def _sklearn(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    probs = np.clip(1 / (1 + np.exp(-logits.astype(np.float64))), EPS, 1 - EPS)
    return roc_auc_score(labels, logits.astype(np.float64)), log_loss(labels, probs, labels=[0, 1])


def test_auc_and_log_loss_of_the_last_samples_match_scikit_learn_within_the_bound():
    rng = np.random.default_rng(0)
    window = ProgressiveWindow(100_000)
    seen_logits, seen_labels = [], []
    for _ in range(60):  # 245,760 samples: the window wraps twice, across batch boundaries
        logits, labels = _ctr_batch(rng, 4096)
        window.add(logits, labels)
        seen_logits.append(logits)
        seen_labels.append(labels)
    logits, labels = np.concatenate(seen_logits)[-100_000:], np.concatenate(seen_labels)[-100_000:]
    exact_auc, exact_loss = _sklearn(logits, labels)
    got = window.metrics()
    assert got.samples == 100_000
    assert abs(got.auc - exact_auc) <= got.auc_bound
    assert got.auc_bound < 1e-4  # the documented order of the bound for a CTR window of 100,000
    assert got.logloss == pytest.approx(exact_loss, rel=1e-9)
    assert window.auc() == got.auc  # the AUC alone (what the progress line asks for) is the same number


def test_the_bound_holds_where_many_predictions_share_a_bucket():
    """A young model's predictions crowd a few buckets: the estimate may be off, but never by more than the
    bound it reports."""
    rng = np.random.default_rng(1)
    logits = rng.normal(-1.1, 0.002, 50_000).astype(np.float32)  # about 8 buckets wide
    labels = (rng.random(50_000) < 0.25 + 40 * (logits + 1.1)).astype(np.float32)
    window = ProgressiveWindow(50_000)
    window.add(logits, labels)
    got = window.metrics()
    exact_auc, _ = _sklearn(logits, labels)
    assert got.auc_bound > 1e-3  # many ties in the histogram
    assert abs(got.auc - exact_auc) <= got.auc_bound


def test_samples_pushed_out_leave_the_histogram():
    rng = np.random.default_rng(2)
    window = ProgressiveWindow(1000)
    old = rng.normal(0, 3, 5000).astype(np.float32)
    window.add(old, (old > 0).astype(np.float32))  # perfectly ranked, then pushed out
    logits, labels = rng.normal(0, 1, 1000).astype(np.float32), rng.integers(0, 2, 1000).astype(np.float32)
    for lo in range(0, 1000, 300):
        window.add(logits[lo:lo + 300], labels[lo:lo + 300])
    got = window.metrics()
    assert window.counts.sum() == 1000 and got.samples == 1000
    assert abs(got.auc - roc_auc_score(labels, logits)) <= got.auc_bound
    assert got.logloss == pytest.approx(_sklearn(logits, labels)[1], rel=1e-9)


def test_a_first_lap_and_a_batch_larger_than_the_window():
    window = ProgressiveWindow(10)
    empty = window.metrics()
    assert empty.samples == 0 and np.isnan(empty.auc)
    window.add(np.array([-2.0, -1.0, 1.0, 2.0], np.float32), np.array([0, 0, 1, 1], np.float32))
    assert window.metrics().auc == 1.0 and window.metrics().samples == 4
    batch = np.linspace(-3, 3, 25).astype(np.float32)
    window.add(batch, (np.arange(25) % 2).astype(np.float32))  # only the last 10 stay
    assert window.seen == 29 and window.metrics().samples == 10
    assert window.metrics().auc == pytest.approx(roc_auc_score(np.arange(15, 25) % 2, batch[15:]))


def test_every_task_has_its_window_and_ranks_add_up():
    rng = np.random.default_rng(3)
    ranks = [ProgressiveWindow(20_000, tasks=2) for _ in range(2)]
    kept = []
    for window in ranks:
        logits = np.stack([_ctr_batch(rng, 20_000)[0], _ctr_batch(rng, 20_000, 2.0)[0]], axis=1)
        labels = (rng.random((20_000, 2)) < 1 / (1 + np.exp(-logits))).astype(np.float32)
        window.add(logits, labels)
        kept.append((logits, labels))
    joined = task_metrics(sum(w.counts for w in ranks), sum(w.loss_sums() for w in ranks))
    logits, labels = (np.concatenate(parts) for parts in zip(*kept))
    for t in range(2):
        exact_auc, exact_loss = _sklearn(logits[:, t], labels[:, t])
        assert joined[t].samples == 40_000
        assert abs(joined[t].auc - exact_auc) <= joined[t].auc_bound
        assert joined[t].logloss == pytest.approx(exact_loss, rel=1e-9)


def test_one_class_has_no_auc():
    counts = np.zeros((2, BUCKETS), np.int64)
    counts[1, 100] = 5
    got = window_metrics(counts, 1.0)
    assert np.isnan(got.auc) and got.samples == 5 and got.logloss == 0.2


def test_the_compiled_pass_keeps_the_buckets_and_losses_of_the_array_version():
    """Each ring slot holds its sample's `bucket_of` code and logit, the histogram counts exactly the window's
    codes, and the loss is `sample_loss`'s sum, over a wrapping ring of two tasks with logits at the edges: the
    clamps, a bucket's exact boundary, infinities and a NaN (bucket 0 and a NaN loss, where the array version's
    cast left it)."""
    rng = np.random.default_rng(4)
    edges = np.array([-np.inf, -LOGIT_RANGE - 1, -LOGIT_RANGE, -1e-30, 0.0, LOGIT_RANGE / BUCKETS * 2 * 7 - LOGIT_RANGE,
                      LOGIT_RANGE - 1e-6, LOGIT_RANGE, 40.0, np.inf, np.nan], np.float32)
    window = ProgressiveWindow(700, tasks=2)
    kept_logits, kept_labels = [], []
    for n in (300, 500, 11, 257):
        logits = rng.normal(0, 6, (n, 2)).astype(np.float32)
        if n == 11:
            logits[:, 0] = edges
        labels = rng.integers(0, 2, (n, 2)).astype(np.float32)
        window.add(logits, labels)
        kept_logits.append(logits)
        kept_labels.append(labels)
    logits, labels = np.concatenate(kept_logits)[-700:], np.concatenate(kept_labels)[-700:]
    slots = (window.seen - 700 + np.arange(700)) % 700
    for t in range(2):
        with np.errstate(invalid="ignore"):  # the NaN's cast
            codes = bucket_of(logits[:, t]) * 2 + (labels[:, t] > 0.5)
        if t == 0:
            nan_at = np.flatnonzero(np.isnan(logits[:, 0]))
            assert nan_at.size == 1 and window.codes[0, slots[nan_at[0]]] == int(labels[nan_at[0], 0] > 0.5)
            codes[nan_at] = labels[nan_at, 0] > 0.5
        np.testing.assert_array_equal(window.codes[t, slots], codes)
        np.testing.assert_array_equal(window.logits[t, slots], logits[:, t])
        assert window.loss_sums()[t] == pytest.approx(sample_loss(logits[:, t], labels[:, t] > 0.5).sum(),
                                                      rel=1e-12, nan_ok=True)
        np.testing.assert_array_equal(window.counts[t], np.bincount(window.codes[t], minlength=2 * BUCKETS))
