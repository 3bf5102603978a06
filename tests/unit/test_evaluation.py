"""find_oracle: where the summary's oracle_auc comes from, and a warning when a configured oracle is unreadable."""
from __future__ import annotations

import json

import numpy as np
import pytest
from structlog.testing import capture_logs

from hybridrec.core.config import from_dict
from hybridrec.core.model.evaluation import EPS, binary_metrics, find_oracle


def config(tmp_path, oracle=None):
    data = {"train": [str(tmp_path / "synth" / "train.tsv")]}
    if oracle is not None:
        data["oracle"] = str(oracle)
    return from_dict({"data": data})


def write_oracle(path, auc=0.8123):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"oracle_auc": auc, "train_rows": 10}))
    return path


def test_configured_oracle(tmp_path):
    path = write_oracle(tmp_path / "elsewhere" / "oracle.json", 0.75)
    write_oracle(tmp_path / "synth" / "oracle.json", 0.9)  # data.oracle wins over the one beside the data
    assert find_oracle(config(tmp_path, path)) == pytest.approx(0.75)


def test_oracle_beside_the_training_file(tmp_path):
    write_oracle(tmp_path / "synth" / "oracle.json", 0.8)
    with capture_logs() as logs:
        assert find_oracle(config(tmp_path)) == pytest.approx(0.8)
    assert not logs


def test_no_oracle_is_none_and_quiet(tmp_path):
    with capture_logs() as logs:
        assert find_oracle(config(tmp_path)) is None
    assert not logs


@pytest.mark.parametrize("content", [None, "not json", json.dumps({"auc": 0.8})])
def test_configured_but_unreadable_oracle_is_none_with_a_warning(tmp_path, content):
    """The compose run's nn-worker-0 once had no data volume: a silent null oracle_auc."""
    path = tmp_path / "data" / "oracle.json"
    if content is not None:
        path.parent.mkdir(parents=True)
        path.write_text(content)
    with capture_logs() as logs:
        assert find_oracle(config(tmp_path, path)) is None
    assert [(e["event"], e["log_level"], e["path"]) for e in logs] == [("oracle_unreadable", "warning", str(path))]


def test_calibration_is_the_mean_prediction_over_the_rate_of_positives():
    assert binary_metrics([1, 0, 0, 0], [0.5, 0.25, 0.25, 0.5])["calibration"] == pytest.approx(1.5 / 1)
    assert binary_metrics([0, 0], [0.1, 0.2])["calibration"] is None  # no positives: no rate to be calibrated to


def test_binary_metrics_one_class_has_no_auc():
    assert binary_metrics([1, 1], [0.2, 0.9])["auc"] is None
    assert binary_metrics([], [])["logloss"] is None


@pytest.mark.parametrize("seed", range(4))
def test_binary_metrics_equal_scikit_learns_ties_included(seed):
    """The NN worker's eval metrics are computed with numpy; scikit-learn's are the reference. Scores on a
    coarse grid make many ties (a tie between a positive and a negative counts 1/2), and some are clipped."""
    from sklearn.metrics import log_loss, roc_auc_score

    rng = np.random.default_rng(seed)
    n = 50_000
    scores = rng.random(n)
    labels = (rng.random(n) < scores * 0.4).astype(np.float32)
    probs = np.round(scores, 2 if seed % 2 else 6)
    probs[:100] = 0.0  # clipped to EPS, as binary_metrics does before both
    got = binary_metrics(labels, probs)
    clipped = np.clip(probs, EPS, 1 - EPS)
    assert got["auc"] == pytest.approx(roc_auc_score(labels, clipped), rel=1e-12)
    assert got["logloss"] == pytest.approx(log_loss(labels, clipped, labels=[0, 1]), rel=1e-9)


def test_auc_of_a_perfect_an_inverted_and_a_constant_ranking():
    labels = np.array([0, 0, 1, 1])
    assert binary_metrics(labels, np.array([0.1, 0.2, 0.8, 0.9]))["auc"] == 1.0
    assert binary_metrics(labels, np.array([0.9, 0.8, 0.2, 0.1]))["auc"] == 0.0
    assert binary_metrics(labels, np.full(4, 0.5))["auc"] == 0.5


def test_labels_other_than_0_and_1_are_refused():
    with pytest.raises(ValueError, match="0 or 1"):
        binary_metrics([0, 2], [0.1, 0.2])
