"""Eval metrics of a CTR model: AUC and log loss (scikit-learn's, not a home-made AUC)."""
from __future__ import annotations

import numpy as np
from sklearn.metrics import log_loss, roc_auc_score

EPS = 1e-7


def binary_metrics(labels: np.ndarray, probs: np.ndarray) -> dict[str, float | None]:
    """AUC (None when only one class is present) and log loss of predicted click probabilities."""
    labels = np.asarray(labels, dtype=np.float64)
    probs = np.clip(np.asarray(probs, dtype=np.float64), EPS, 1 - EPS)
    if labels.size == 0:
        return {"auc": None, "logloss": None}
    auc = float(roc_auc_score(labels, probs)) if 0 < labels.sum() < labels.size else None
    return {"auc": auc, "logloss": float(log_loss(labels, probs, labels=[0, 1]))}
