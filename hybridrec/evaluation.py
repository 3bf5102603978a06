"""Eval metrics of a CTR model: AUC and log loss (scikit-learn's, not a home-made AUC)."""
from __future__ import annotations

import json
from pathlib import Path

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


def find_oracle(config) -> float | None:
    """The planted model's oracle AUC: data.oracle, else oracle.json beside the first training file."""
    candidates = [config.data.oracle] if config.data.oracle else [str(Path(p).parent / "oracle.json")
                                                                  for p in config.data.train[:1]]
    for path in candidates:
        try:
            return float(json.loads(Path(path).read_text())["oracle_auc"])
        except (OSError, KeyError, ValueError, TypeError):
            continue
    return None
