"""Tasks by kind (hybridrec/core/model/tasks.py): the config's label entries, weight column and loss; the losses and
their
weights; the user's loss and its refusals; the readers' regression labels and weights; weighted metrics; and
answers by kind, eager and compiled."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

from hybridrec.core.config import ConfigError, TaskConfig, from_dict
from hybridrec.core.model.evaluation import binary_metrics, regression_metrics, roc_auc
from hybridrec.core.model.tasks import Tasks, answers
from services.dataloader.columns import BadLinePolicy, ColumnSpec, RowError, convert
from services.inference.compiled import CompiledDense
from services.inference.model import load_model
from tests.inference_util import make_config_bundle

REPO = Path(__file__).resolve().parents[2]


def _config(labels, **extra):
    data = {"format": "parquet", "train": ["t.parquet"], "labels": labels, "dense_columns": ["d0"],
            **extra.pop("data", {})}
    return from_dict({"data": data, "num_dense": 1, "features": [{"name": "user_id", "group": 0, "dim": 4}],
                      **extra})


def test_label_entries_take_a_kind_and_a_loss_and_plain_names_stay_binary():
    config = _config(["click", {"name": "watch_time", "kind": "regression", "loss": "huber", "huber_delta": 5}],
                     data={"weight_column": "w"})
    assert config.data.label_names == ["click", "watch_time"] and config.label_columns == 3
    assert [(t.kind, t.loss_name) for t in config.data.tasks] == [("binary", "bce"), ("regression", "huber")]
    for labels, extra, key in [
        ([{"name": "x", "loss": "mse"}], {}, "bce"),
        ([{"name": "x", "kind": "regression", "loss": "bce"}], {}, "regression task trains with mse or huber"),
        (["click"], {"weight_column": "click"}, "data.weight_column"),
    ]:
        with pytest.raises(ConfigError, match=key):
            _config(labels, data=extra)
    tsv = {"data": {"train": ["t.tsv"]}}
    with pytest.raises(ConfigError, match="data.labels.0.kind"):
        from_dict({**tsv, "data": {**tsv["data"], "labels": [{"name": "y", "kind": "regression"}]}})
    with pytest.raises(ConfigError, match="data.weight_column"):
        from_dict({"data": {"train": ["t.tsv"], "weight_column": "w"}})
    with pytest.raises(ConfigError, match="training.loss"):
        _config(["click"], training={"loss": "not a path"})


def _tasks(labels, weighted=False, loss=None, task_weights=None):
    config = _config(labels, data={"weight_column": "w"} if weighted else {},
                     training={"loss": loss, "task_weights": task_weights})
    return Tasks.from_config(config)


def test_weights_of_one_give_the_unweighted_loss_bit_for_bit_and_weights_weight_each_sample():
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.normal(size=(64, 2)).astype(np.float32))
    labels = torch.from_numpy(np.stack([rng.integers(0, 2, 64), rng.exponential(3, 64)], 1).astype(np.float32))
    spec = ["click", {"name": "watch_time", "kind": "regression"}]
    plain = _tasks(spec, task_weights=[1.0, 0.5]).loss(logits, labels)
    ones = _tasks(spec, weighted=True, task_weights=[1.0, 0.5]).loss(logits, torch.cat([labels, torch.ones(64, 1)], 1))
    assert torch.equal(plain, ones)
    want = F.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0]) + 0.5 * F.mse_loss(logits[:, 1], labels[:, 1])
    assert torch.allclose(plain, want)
    # a weight of 3 counts a sample three times: the same loss as the batch with it repeated
    weights = torch.ones(64)
    weights[:10] = 3.0
    weighted = _tasks(spec, weighted=True, task_weights=[1.0, 0.5]).loss(logits, torch.cat([labels, weights[:, None]], 1))
    repeat = torch.cat([torch.arange(64), torch.arange(10), torch.arange(10)])
    assert torch.allclose(weighted, _tasks(spec, task_weights=[1.0, 0.5]).loss(logits[repeat], labels[repeat]))
    huber = _tasks([{"name": "y", "kind": "regression", "loss": "huber", "huber_delta": 2.0}])
    assert torch.allclose(huber.loss(logits[:, 1], labels[:, 1]), F.huber_loss(logits[:, 1], labels[:, 1], delta=2.0))


@pytest.fixture
def loss_module(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        def plus_seven(logits, labels, weights):
            return (F.binary_cross_entropy_with_logits(logits, labels, reduction="none") * weights).mean() + 7.0

        def a_vector(logits, labels, weights):
            return logits * 2

        def a_float(logits, labels, weights):
            return 1.0

        def nan(logits, labels, weights):
            return logits.sum() * float("nan")

        def raises(logits, labels, weights):
            raise RuntimeError("no loss today")

        not_a_function = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_losses"
    sys.modules.pop("my_losses", None)


def test_the_users_loss_is_the_loss_and_what_it_cannot_be_is_refused_naming_the_key(loss_module):
    logits, labels = torch.tensor([0.5, -1.0], requires_grad=True), torch.tensor([1.0, 0.0])
    tasks = _tasks(["click"], loss=f"{loss_module}:plus_seven")
    tasks.probe()
    loss = tasks.loss(logits, labels)
    assert torch.allclose(loss, F.binary_cross_entropy_with_logits(logits, labels) + 7.0)
    loss.backward()
    assert logits.grad is not None
    for name, message in [("a_vector", "shape"), ("a_float", "a float, not a floating-point scalar"),
                          ("nan", "returned nan"), ("raises", "RuntimeError: no loss today"),
                          ("not_a_function", "not a function"), ("missing", "does not import")]:
        with pytest.raises(ConfigError, match=f"training.loss: .*{message}"):
            _tasks(["click"], loss=f"{loss_module}:{name}").probe()
    with pytest.raises(ConfigError, match="training.loss: 'no_such_module:f' does not import"):
        _tasks(["click"], loss="no_such_module:f")


def _table(**columns) -> pa.Table:
    n = len(next(iter(columns.values())))
    return pa.table({"d0": np.zeros(n, np.float32), "user_id": np.arange(n, dtype=np.int64), **columns})


def test_readers_take_regression_labels_and_weights_and_name_a_bad_one():
    spec = ColumnSpec.from_config(_config(["click", {"name": "watch_time", "kind": "regression"}],
                                          data={"weight_column": "w"}))
    good = _table(click=np.array([1, 0, 1], np.int8), watch_time=np.array([12.5, 0.0, -3.0], np.float64),
                  w=np.array([1.0, 10.0, 0.0], np.float32))
    rows = convert(good, spec, "f.parquet", 0, 0, BadLinePolicy.ERROR).rows
    np.testing.assert_array_equal(rows.labels, [[1, 12.5, 1], [0, 0, 10], [1, -3, 0]])
    for column, values, what in [("watch_time", [1.0, np.nan, 2.0], "label column 'watch_time' is nan"),
                                 ("watch_time", [1.0, 2.0, None], "label column 'watch_time' is null"),
                                 ("watch_time", [1.0, 1e39, 2.0], "label column 'watch_time' is 1e"),
                                 ("w", [1.0, -1.0, 2.0], "weight column 'w' is -1.0, not a finite number >= 0"),
                                 ("w", [np.inf, 1.0, 2.0], "weight column 'w' is inf")]:
        bad = good.set_column(good.schema.get_field_index(column), column, pa.array(values, pa.float64()))
        with pytest.raises(RowError, match=r"f.parquet, row \d \(file row \d\): " + what):
            convert(bad, spec, "f.parquet", 0, 0, BadLinePolicy.ERROR)
        skipped = convert(bad, spec, "f.parquet", 0, 0, BadLinePolicy.SKIP)
        assert skipped.bad == 1 and skipped.rows.labels.shape == (2, 3)


def test_weighted_metrics_count_each_sample_its_weight():
    rng = np.random.default_rng(1)
    scores, positive = np.round(rng.random(500), 2), rng.random(500) < 0.3
    weights = rng.integers(0, 4, 500)
    repeated = np.repeat(np.arange(500), weights)
    got = binary_metrics(positive, scores, weights.astype(np.float32))
    want = binary_metrics(positive[repeated], scores[repeated])
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-12) and got["logloss"] == pytest.approx(want["logloss"])
    assert got["calibration"] == pytest.approx(want["calibration"])
    assert binary_metrics(positive, scores, np.ones(500))["auc"] == pytest.approx(roc_auc(positive, scores))
    values, labels = rng.normal(size=500), rng.normal(size=500)
    r = regression_metrics(labels, values, weights)
    assert r["rmse"] == pytest.approx(np.sqrt(np.mean((values - labels)[repeated] ** 2)))
    assert r["mae"] == pytest.approx(np.mean(np.abs(values - labels)[repeated]))
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        regression_metrics(labels, values, -np.ones(500))


def test_a_regression_output_is_answered_as_it_is_eager_and_compiled(tmp_path):
    out = torch.tensor([[-2.0, 40.0], [0.0, -3.0]])
    heads = [TaskConfig(name="click"), TaskConfig(name="watch_time", kind="regression")]
    np.testing.assert_allclose(answers(out, heads), [[torch.sigmoid(torch.tensor(-2.0)), 40.0], [0.5, -3.0]])
    heads[1] = TaskConfig(name="watch_time", kind="regression", offset=30, scale=10)
    np.testing.assert_allclose(answers(out, heads)[:, 1], [430.0, 0.0])
    np.testing.assert_allclose(answers(out[:, 1], heads[1:]), [430.0, 0.0])
    bundle = tmp_path / "bundle"
    make_config_bundle(bundle, REPO / "examples" / "watch_time_parquet.yaml", vocabulary=50)
    model = load_model(bundle, compile=False)
    assert [h.kind for h in model.manifest.task_heads] == ["binary", "regression"]
    with torch.no_grad():  # watch time's tower answers 40 more (1,230 minutes more): no probability could
        model.model.towers[1][-1].bias.add_(40.0)
    bags = _probe(model, 3)
    eager = model.forward(np.zeros((3, model.manifest.num_dense), np.float32), bags)
    assert eager.shape == (3, 2) and ((eager[:, 0] > 0) & (eager[:, 0] < 1)).all() and (eager[:, 1] > 30).all()
    compiled = CompiledDense.build(model.model, model.pooler.pool_host(bags), model.manifest.num_dense,
                                   heads=tuple(model.manifest.task_heads))
    assert compiled is not None  # it answered as the eager model on its own check inputs
    np.testing.assert_allclose(compiled(np.zeros((3, model.manifest.num_dense), np.float32),
                                        model.pooler.pool_host(bags)), eager, atol=1e-5, rtol=0)


def _probe(model, n: int):
    """n samples of no IDs (every feature absent), rows filled in as the service fills them."""
    features = len(model.manifest.features)
    bags = model.pooler.from_columns(np.zeros((n, features), np.uint64), np.zeros((n, features), bool))[1]
    bags.rows = {d: np.zeros((0, d), np.float32) for d in model.pooler.dims}
    return bags


def test_the_summary_reports_each_task_by_its_kind_weighted():
    from hybridrec.core.layouts.summary import RunSummary, task_row
    from services.nn_worker.results import _task_metrics

    config = _config(["click", {"name": "watch_time", "kind": "regression"}], data={"weight_column": "w"})
    labels = np.array([[1, 10.0, 1], [0, 20.0, 3], [1, 40.0, 0]], np.float32)  # the last row weighs nothing
    preds = np.array([[0.9, 12.0], [0.2, 20.0], [0.1, 0.0]], np.float32)
    click, watch = _task_metrics(config, labels, preds)
    assert (click.kind, click.auc, watch.kind, watch.auc) == ("binary", 1.0, "regression", None)
    assert click.calibration == pytest.approx((0.9 * 1 + 0.2 * 3) / 1)  # weighted mean prediction / weighted rate
    assert watch.calibration is None
    assert watch.rmse == pytest.approx(np.sqrt((1 * 4 + 3 * 0) / 4)) and watch.mae == pytest.approx(2 / 4)
    assert task_row(watch.model_dump(), str)[0] == "task watch_time: eval RMSE / oracle / MAE"
    summary = RunSummary.model_construct(tasks=[click, watch], auc=None, logloss=None, rmse=None, mae=None)
    assert set(summary.task_metrics()) == {"eval_auc_click", "eval_logloss_click", "eval_calibration_click",
                                           "eval_rmse_watch_time", "eval_mae_watch_time"}
