"""Sequences (pooling none), multi-task models and results, and the multi-task synthetic data."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import ConfigError, FeatureConfig, from_dict, load_config
from hybridrec.core.wire.frames import Embeddings
from hybridrec.core.wire.jagged import KeyedBags
from hybridrec.core.model.models import DIN, DNN, MMoE, build_model, feature_infos
from hybridrec.core.model.pooling import Pooler, SeqEmbedding
from hybridrec.core.layouts.summary import RunSummary
from services.nn_worker.results import _task_metrics

VALUES = ValueCodec(fp16=False)
CPU = torch.device("cpu")


def _features():
    return [FeatureConfig(name="target", group=2, dim=4),
            FeatureConfig(name="hist", group=2, dim=4, kind="list", pooling="none", max_len=3),
            FeatureConfig(name="tags", group=3, dim=2, kind="list", pooling="mean")]


def _frame():
    """Batch of 3: target rows (1 unique per sample), hist sequences of lengths 2, 0, 3, tags bags."""
    rng = np.random.default_rng(0)
    rows4 = rng.standard_normal((2 + 3, 4)).astype(np.float32)  # target: 2 unique rows, hist: 3 unique rows
    rows2 = rng.standard_normal((2, 2)).astype(np.float32)
    pos = np.array([0, 1, 0,  2, 0,  1, 1, 2,  0, 1, 1], np.uint16)
    lengths = np.array([[1, 1, 1], [2, 0, 3], [2, 0, 1]], np.uint16)
    frame = Embeddings(KeyedBags(pos, lengths), np.array([2, 3, 2], np.int32), {4: rows4, 2: rows2})
    return frame.encode(VALUES), rows4, rows2


def test_sequences_are_gathered_in_order_and_gradients_reach_each_unique_row():
    buf, rows4, rows2 = _frame()
    pooler = Pooler(_features(), VALUES)
    leaves, out = pooler.pool(pooler.decode(buf, 3), CPU, grad=True)
    seq = out["hist"]
    assert isinstance(seq, SeqEmbedding) and seq.values.shape == (3, 3, 4) and seq.lengths.tolist() == [2, 0, 3]
    hist_rows = rows4[2:]
    np.testing.assert_allclose(seq.values[0, :2].detach().numpy(), hist_rows[[2, 0]])  # order kept, oldest first
    assert (seq.values[0, 2] == 0).all() and (seq.values[1] == 0).all()
    np.testing.assert_allclose(seq.values[2].detach().numpy(), hist_rows[[1, 1, 2]])
    np.testing.assert_allclose(out["tags"].detach().numpy(), [rows2[[0, 1]].mean(0), np.zeros(2), rows2[1]],
                               rtol=1e-6)
    (seq.values.sum() * 1.0).backward()
    grad = leaves[4].grad.numpy()
    assert (grad[:2] == 0).all()  # target rows: untouched by this loss
    # one gradient per unique row, summed over its places: row 0 at [0, 1]; row 1 at [2, 0], [2, 1]; row 2 at
    # [0, 0] and [2, 2]
    np.testing.assert_array_equal(grad[2:], [[1] * 4, [2] * 4, [2] * 4])


def test_empty_batch_has_empty_sequences():
    pooler = Pooler(_features(), VALUES)
    _, out = pooler.pool(pooler.empty(5), CPU, grad=False)
    assert out["hist"].values.shape == (5, 3, 4) and out["hist"].lengths.sum() == 0
    assert out["target"].shape == (5, 4)


@pytest.mark.parametrize("path, kwargs", [
    ("hybridrec.models:MMoE", {"sequence": "hist", "target": "target", "expert_hidden": [8, 4]}),
    ("hybridrec.models:DIN", {"sequence": "hist", "target": "target", "hidden": [8]}),
    ("hybridrec.models:DNN", {"hidden": [8]}),
])
def test_models_give_one_logit_per_task(path, kwargs):
    buf, _, _ = _frame()
    pooler = Pooler(_features(), VALUES)
    _, emb = pooler.pool(pooler.decode(buf, 3), CPU, grad=False)
    model = build_model(path, feature_infos(_features()), 2, kwargs, num_tasks=2)
    assert model(torch.zeros(3, 2), emb).shape == (3, 2)


def test_din_with_the_sequence_pooled_is_the_same_model_without_attention():
    pooled = [f if f.name != "hist" else f.model_copy(update={"pooling": "sum"}) for f in _features()]
    a = DIN(features=feature_infos(_features()), num_dense=2, sequence="hist", target="target")
    b = DIN(features=feature_infos(pooled), num_dense=2, sequence="hist", target="target")
    assert a.reader.attention is not None and b.reader.attention is None
    assert a.net[0].in_features == b.net[0].in_features
    with pytest.raises(ValueError, match="model.kwargs.sequence: no feature 'nope'"):
        DIN(features=feature_infos(_features()), num_dense=2, sequence="nope", target="target")
    with pytest.raises(ValueError, match="sequence and target go together"):
        MMoE(features=feature_infos(_features()), num_dense=2, sequence="hist")


def test_single_task_models_keep_their_output():
    model = DNN(features=feature_infos(_features()[:1]), num_dense=2, hidden=[4])
    assert model(torch.zeros(3, 2), {"target": torch.zeros(3, 4)}).shape == (3,)


def test_per_task_metrics_and_oracles(tmp_path):
    (tmp_path / "oracle.json").write_text(json.dumps({"oracle_auc": 0.8, "tasks": {"a": {"oracle_auc": 0.8},
                                                                                    "b": {"oracle_auc": 0.7}}}))
    config = from_dict({"data": {"train": [str(tmp_path / "t.parquet")], "format": "parquet", "labels": ["a", "b"]},
                        "features": [{"name": "x", "group": 0}]})
    labels = np.array([[0, 1], [1, 0], [1, 1], [0, 0]], np.float32)
    preds = np.array([[0.1, 0.9], [0.8, 0.8], [0.7, 0.7], [0.2, 0.1]], np.float32)
    tasks = _task_metrics(config, labels, preds)
    assert [(t.name, t.auc, t.oracle_auc) for t in tasks] == [("a", 1.0, 0.8), ("b", 0.75, 0.7)]
    summary = RunSummary.model_construct(tasks=tasks, auc=tasks[0].auc, logloss=tasks[0].logloss)
    metrics = summary.task_metrics()
    assert metrics["eval_auc_a"] == 1.0 and metrics["eval_auc_b"] == 0.75 and "eval_logloss_b" in metrics


def test_set_reaches_into_lists(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {train: [x]}\nfeatures: [{name: C1, group: 0}, {name: C2, group: 1}]\n")
    assert load_config(path, ["features.1.pooling=mean"]).features[1].pooling.value == "mean"
    with pytest.raises(ConfigError, match="features.5 is not an index of a 2-entry list"):
        load_config(path, ["features.5.pooling=mean"])


def test_multitask_synth_plants_an_order_and_target_dependent_sequence_effect(tmp_path):
    import pyarrow.parquet as pq

    from hybridrec.app.data.synth_parquet import SEQ_DECAY, SEQ_SCALE, SEQ_STALE, synthesize_multitask

    s = synthesize_multitask(tmp_path, rows=20_000, eval_rows=10_000, seed=1)
    oracle = json.loads((tmp_path / "oracle.json").read_text())
    assert set(oracle["tasks"]) == {"click", "conversion", "watch_time"} and oracle["oracle_auc"] == oracle["tasks"]["click"]["oracle_auc"]
    assert 0.65 < s.oracle_auc["click"] < 0.9 and 0.6 < s.oracle_auc["conversion"] < 0.9
    assert oracle["label_correlation"] > 0.02  # the tasks share effects
    table = pq.read_table(tmp_path / "train.parquet")
    assert table.schema.field("hist_cats").type.value_type.bit_width == 64
    assert abs(float(np.mean(table.column("click").to_numpy())) - 0.2) < 0.02
    # the planted effect of a match falls with its age, below zero for old ones: the match count alone does not
    # tell it (what a sum-pooled history could at best recover)
    hist, cat = table.column("hist_cats").to_pylist()[:5000], table.column("item_cat").to_numpy()[:5000]
    effect = np.array([SEQ_SCALE * sum(SEQ_DECAY ** (len(h) - 1 - j) - SEQ_STALE for j, c in enumerate(h) if c == t)
                       for h, t in zip(hist, cat)])
    matches = np.array([sum(c == t for c in h) for h, t in zip(hist, cat)])
    assert np.std(effect) > 0.3 and abs(np.corrcoef(effect, matches)[0, 1]) < 0.7


def test_report_lists_every_task():
    from hybridrec.app.report.page import summary_rows

    rows = dict(summary_rows({"auc": 0.7, "tasks": [{"name": "click", "auc": 0.75, "oracle_auc": 0.76,
                                                     "logloss": 0.45},
                                                    {"name": "conversion", "auc": 0.68, "logloss": 0.3}]}))
    assert rows["Task click: eval AUC / oracle / logloss / calibration"].startswith("0.75")
    assert "Task conversion: eval AUC / oracle / logloss / calibration" in rows
