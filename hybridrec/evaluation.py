"""Eval metrics of a CTR model: AUC and log loss (scikit-learn's, not a home-made AUC)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hybridrec import log

EPS = 1e-7


def binary_metrics(labels: np.ndarray, probs: np.ndarray) -> dict[str, float | None]:
    """AUC (None when only one class is present) and log loss of predicted click probabilities."""
    # scikit-learn (and scipy under it) costs seconds of CPU to import: not at every service's start-up.
    from sklearn.metrics import log_loss, roc_auc_score

    labels = np.asarray(labels, dtype=np.float64)
    probs = np.clip(np.asarray(probs, dtype=np.float64), EPS, 1 - EPS)
    if labels.size == 0:
        return {"auc": None, "logloss": None}
    auc = float(roc_auc_score(labels, probs)) if 0 < labels.sum() < labels.size else None
    return {"auc": auc, "logloss": float(log_loss(labels, probs, labels=[0, 1]))}


def find_oracle(config) -> float | None:
    """The planted model's oracle AUC: data.oracle, else oracle.json beside the first training file.

    None when there is no oracle. A data.oracle that is set but cannot be read
    (e.g. a container without the data volume) is logged as a warning, so a
    null oracle_auc in the summary is explained in the log.
    """
    if config.data.oracle:
        try:
            return _read_oracle(Path(config.data.oracle))
        except (OSError, KeyError, ValueError, TypeError) as exc:
            log.get(__name__).warning("oracle_unreadable", path=config.data.oracle,
                                      error=f"{type(exc).__name__}: {exc}")
            return None
    for train in config.data.train[:1]:
        try:
            return _read_oracle(Path(train).parent / "oracle.json")
        except (OSError, KeyError, ValueError, TypeError):
            continue
    return None


def _read_oracle(path: Path) -> float:
    return float(json.loads(path.read_text())["oracle_auc"])


def find_task_oracles(config) -> dict[str, float]:
    """Oracle AUC of each task: the `tasks` entry of the oracle file (`hybridrec data synth --format parquet`
    writes one per label column), empty when there is none."""
    paths = [Path(config.data.oracle)] if config.data.oracle else [Path(t).parent / "oracle.json"
                                                                    for t in config.data.train[:1]]
    for path in paths:
        try:
            tasks = json.loads(path.read_text()).get("tasks", {})
            return {name: float(entry["oracle_auc"]) for name, entry in tasks.items()}
        except (OSError, KeyError, ValueError, TypeError, AttributeError):
            continue
    return {}
