"""Eval metrics: a binary task's exact ROC AUC and log loss, a regression task's RMSE and MAE, each
optionally weighted by the samples' weights (`data.weight_column`).

Both are computed here with numpy rather than with scikit-learn's `roc_auc_score` and `log_loss`, which give
the same numbers (tests/unit/test_evaluation.py checks them against each other, ties included): importing
scikit-learn and scipy cost 2.4 s of CPU in the NN worker that evaluates, at the end of every run, when
everything else waits for the eval result. The AUC is the Mann-Whitney statistic: one sort, O(n log n), as
scikit-learn's is.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hybridrec.core.runtime import log

EPS = 1e-7


def binary_metrics(labels: np.ndarray, probs: np.ndarray,
                   weights: np.ndarray | None = None) -> dict[str, float | None]:
    """AUC (None when only one class is present), log loss and calibration (the mean predicted probability over
    the rate of positives: 1 is calibrated; None without positives) of predicted click probabilities; with
    `weights`, each sample counts its weight (a pair of samples in the AUC the product of theirs)."""
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    probs = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), EPS, 1 - EPS)
    if labels.size != probs.size:
        raise ValueError(f"{labels.size} labels and {probs.size} predictions")
    if labels.size == 0:
        return {"auc": None, "logloss": None, "calibration": None}
    positive = labels == 1
    if not np.all(positive | (labels == 0)):
        raise ValueError("labels must be 0 or 1")
    losses = np.where(positive, np.log(probs), np.log1p(-probs))
    if weights is None:
        auc = roc_auc(positive, probs) if 0 < positive.sum() < labels.size else None
        calibration = float(probs.sum() / positive.sum()) if positive.any() else None
        return {"auc": auc, "logloss": -float(np.mean(losses)), "calibration": calibration}
    weights = _weights(weights, labels.size)
    pos_w, neg_w = float(weights[positive].sum()), float(weights[~positive].sum())
    auc = weighted_roc_auc(positive, probs, weights) if pos_w > 0 and neg_w > 0 else None
    return {"auc": auc, "logloss": -float(np.sum(weights * losses) / (pos_w + neg_w)) if pos_w + neg_w else None,
            "calibration": float(np.sum(weights * probs) / pos_w) if pos_w > 0 else None}


def regression_metrics(labels: np.ndarray, values: np.ndarray,
                       weights: np.ndarray | None = None) -> dict[str, float | None]:
    """RMSE and MAE of predicted values (weighted means of the squared and absolute errors with `weights`)."""
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if labels.size != values.size:
        raise ValueError(f"{labels.size} labels and {values.size} predictions")
    w = np.ones(labels.size) if weights is None else _weights(weights, labels.size)
    if labels.size == 0 or not w.sum():
        return {"rmse": None, "mae": None}
    error = values - labels
    return {"rmse": float(np.sqrt(np.sum(w * error * error) / w.sum())),
            "mae": float(np.sum(w * np.abs(error)) / w.sum())}


def _weights(weights: np.ndarray, n: int) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64).reshape(-1)
    if weights.size != n:
        raise ValueError(f"{n} labels and {weights.size} weights")
    if not np.all(np.isfinite(weights) & (weights >= 0)):
        raise ValueError("weights must be finite and >= 0")
    return weights


def weighted_roc_auc(positive: np.ndarray, scores: np.ndarray, weights: np.ndarray) -> float:
    """`roc_auc` with each sample counted `weights` times: the weighted share of (positive, negative) pairs
    ordered right, a tie counting 1/2. Equal weights give `roc_auc`'s value. Scores are sorted, and each run
    of equal scores takes its positives' weight times the negative weight below it plus half its own."""
    order = np.argsort(scores, kind="stable")
    ordered = scores[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    pos_w = np.add.reduceat(np.where(positive[order], weights[order], 0.0), starts)
    neg_w = np.add.reduceat(np.where(positive[order], 0.0, weights[order]), starts)
    below = np.cumsum(neg_w) - neg_w
    return float(np.sum(pos_w * (below + 0.5 * neg_w)) / (pos_w.sum() * neg_w.sum()))


def roc_auc(positive: np.ndarray, scores: np.ndarray) -> float:
    """The probability that a random positive scores above a random negative, a tie counting 1/2: the area
    under the ROC curve (what scikit-learn's `roc_auc_score` computes). From the positives' ranks among all
    scores, tied scores sharing their average rank; both classes must be present."""
    order = np.argsort(scores, kind="stable")
    ordered = scores[order]
    n = ordered.size
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])  # where each run of equal scores begins
    ends = np.r_[starts[1:], n]
    ranks = np.repeat((starts + ends + 1) / 2.0, ends - starts)  # 1-based, a tie's average
    n_pos = int(np.count_nonzero(positive))
    rank_sum = float(ranks[positive[order]].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * (n - n_pos))


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


def find_task_oracles(config) -> dict[str, dict[str, float]]:
    """Each task's oracle figures (`oracle_auc` of a binary task, `oracle_rmse` and `oracle_mae` of a regression
    one): the `tasks` entry of the oracle file (`hybridrec data synth --format parquet` writes one per label
    column), empty when there is none."""
    paths = [Path(config.data.oracle)] if config.data.oracle else [Path(t).parent / "oracle.json"
                                                                    for t in config.data.train[:1]]
    for path in paths:
        try:
            tasks = json.loads(path.read_text()).get("tasks", {})
            return {name: {key: float(entry[key]) for key in ("oracle_auc", "oracle_rmse", "oracle_mae")
                           if entry.get(key) is not None} for name, entry in tasks.items()}
        except (OSError, KeyError, ValueError, TypeError, AttributeError):
            continue
    return {}
