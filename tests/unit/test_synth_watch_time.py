"""The multi-task Parquet data's regression label and sample weights (hybridrec/app/data/synth_parquet.py):
watch_time, whose true mean is a function of the file's features and whose oracle RMSE oracle.json records
beside the binary tasks' AUCs,
and the weight column, 1 by default, 1 / R on the training negatives kept by --negative-rate R. Neither
changes any other column for the same seed: a regression head and weighted training are judged against known
answers, on the data that the binary tasks' tests already know."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from hybridrec.app.cli import app
from hybridrec.app.data.synth_parquet import (SEQ_DECAY, SEQ_SCALE, SEQ_STALE, WATCH_SHARE, _build,
                                         synthesize_multitask)

ROWS, EVAL_ROWS, SEED = 40_000, 10_000, 3
RATE = 0.1
PINNED_COLUMNS = ("click", "conversion", "d0", "d1", "d2", "d3", "user_id", "item_id", "item_cat", "tags",
                  "hist_cats")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same seed written twice: as is, and with the training negatives down-sampled to RATE."""
    root = tmp_path_factory.mktemp("watch")
    synthesize_multitask(root / "full", rows=ROWS, eval_rows=EVAL_ROWS, seed=SEED)
    synthesize_multitask(root / "sampled", rows=ROWS, eval_rows=EVAL_ROWS, seed=SEED, negative_rate=RATE)
    return root


def _oracle(path) -> dict:
    return json.loads((path / "oracle.json").read_text())


def _row_sums(column, weight_of, rows: int) -> np.ndarray:
    """Per row of a list column, the sum of weight_of(values, row of each value, position from the newest)."""
    lists = column.combine_chunks()
    offsets = lists.offsets.to_numpy()
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(rows), lengths)
    age = np.repeat(offsets[1:], lengths) - 1 - np.arange(offsets[-1])
    return np.bincount(row, weights=weight_of(lists.values.to_numpy(), row, age), minlength=rows), lengths


def _true_watch_mean(table, seed: int) -> np.ndarray:
    """watch_time's true mean recomputed from the file's columns and the planted effects: what a model of
    these features can learn."""
    m = _build(seed)
    n = table.num_rows
    user = table.column("user_id").combine_chunks()
    user_term = np.where(user.is_null().to_numpy(zero_copy_only=False), 0.0,
                         m.user_eff[user.fill_null(0).to_numpy()])
    item = np.array([int(name[2:], 16) for name in table.column("item_id").to_pylist()])
    cat = table.column("item_cat").to_numpy()
    tag_sum, tag_count = _row_sums(table.column("tags"), lambda v, row, age: m.tag_eff[v], n)
    seq, _ = _row_sums(table.column("hist_cats"),
                       lambda v, row, age: (v == cat[row]) * (SEQ_DECAY ** age - SEQ_STALE), n)
    shared = user_term + m.item_eff[item] + m.cat_eff[cat] + tag_sum / np.sqrt(tag_count) + SEQ_SCALE * seq
    dense = np.stack([table.column(f"d{j}").to_numpy().astype(np.float64) for j in range(4)], 1)
    return np.exp(WATCH_SHARE * shared + dense @ m.dense_watch + m.watch_bias)


def test_watch_time_is_finite_positive_and_its_oracle_is_the_true_means_error(data):
    oracle = _oracle(data / "full")
    watch = oracle["tasks"]["watch_time"]
    for name in ("train", "eval"):
        table = pq.read_table(data / "full" / f"{name}.parquet")
        assert str(table.schema.field("watch_time").type) == "float"
        values = table.column("watch_time").to_numpy()
        assert np.isfinite(values).all() and (values > 0).all(), name
    table = pq.read_table(data / "full" / "eval.parquet")
    label = table.column("watch_time").to_numpy().astype(np.float64)
    error = label - _true_watch_mean(table, SEED)
    assert watch["oracle_rmse"] == pytest.approx(math.sqrt(np.mean(error ** 2)), rel=1e-5)
    assert watch["oracle_mae"] == pytest.approx(np.mean(np.abs(error)), rel=1e-5)
    assert watch["eval_mean"] == pytest.approx(label.mean(), rel=1e-5)
    # the features hold much of it: the true mean beats the best constant by far
    assert watch["oracle_rmse"] < 0.8 * np.std(label) and watch["oracle_rmse"] < 0.8 * watch["mean_rmse"]
    assert 20 < watch["mean"] < 40 and watch["kind"] == "regression"


def test_oracle_keeps_its_keys_and_records_the_eval_click_rate(data):
    oracle = _oracle(data / "full")
    assert list(oracle["tasks"]) == ["click", "conversion", "watch_time"]
    assert oracle["oracle_auc"] == oracle["tasks"]["click"]["oracle_auc"]
    eval_ = pq.read_table(data / "full" / "eval.parquet")
    for task in ("click", "conversion"):
        entry = oracle["tasks"][task]
        assert {"oracle_auc", "oracle_logloss", "rate"} <= set(entry)
        assert entry["eval_rate"] == pytest.approx(eval_.column(task).to_numpy().mean(), abs=1e-6)
    assert oracle["negative_rate"] is None and oracle["train_rows_written"] == ROWS


def test_weight_is_one_on_every_row_by_default(data):
    for name in ("train", "eval"):
        table = pq.read_table(data / "full" / f"{name}.parquet")
        assert str(table.schema.field("weight").type) == "float"
        assert (table.column("weight").to_numpy() == 1.0).all(), name


def test_negative_rate_keeps_a_share_of_the_training_negatives_at_weight_one_over_it(data):
    full = pq.read_table(data / "full" / "train.parquet")
    sampled = pq.read_table(data / "sampled" / "train.parquet")
    click, weight = sampled.column("click").to_numpy(), sampled.column("weight").to_numpy()
    full_click = full.column("click").to_numpy()
    negatives = int((full_click == 0).sum())
    kept = int((click == 0).sum())
    assert abs(kept - RATE * negatives) < 5 * math.sqrt(negatives * RATE * (1 - RATE)), (kept, negatives)
    assert (weight[click == 0] == np.float32(1 / RATE)).all() and (weight[click == 1] == 1.0).all()
    assert (click == 1).sum() == (full_click == 1).sum()  # every positive kept
    # the kept rows are rows of the full file, in order: the down-sampling draws from a stream of its own
    drawn = full.filter(np.isin(_row_key(full), _row_key(sampled)))
    assert drawn.drop_columns(["weight"]).equals(sampled.drop_columns(["weight"]))
    # weighted, the kept rows estimate the full file's click rate and mean watch time
    assert np.average(click, weights=weight) == pytest.approx(full_click.mean(), rel=0.05)
    assert np.average(sampled.column("watch_time").to_numpy(), weights=weight) == pytest.approx(
        full.column("watch_time").to_numpy().mean(), rel=0.05)
    assert pq.read_table(data / "sampled" / "eval.parquet").equals(pq.read_table(data / "full" / "eval.parquet"))
    oracle, plain = _oracle(data / "sampled"), _oracle(data / "full")
    assert oracle["negative_rate"] == RATE and oracle["train_rows_written"] == sampled.num_rows
    assert oracle["tasks"] == plain["tasks"]


def _row_key(table) -> np.ndarray:
    """A row's d0 and d1 bits as one integer: unique to a row in practice, unlike d0 alone."""
    d0, d1 = (table.column(name).to_numpy().view(np.uint32).astype(np.uint64) for name in ("d0", "d1"))
    return (d0 << np.uint64(32)) | d1


def _digest(path) -> str:
    """A hash of the columns that existed before watch_time and weight, independent of Parquet's encoding."""
    table = pq.read_table(path, columns=list(PINNED_COLUMNS))
    h = hashlib.sha256()
    for name in PINNED_COLUMNS:
        column = table.column(name).combine_chunks()
        if name == "user_id":
            values = column.fill_null(-1).to_numpy()
        elif name == "item_id":
            values = np.frombuffer("\n".join(column.to_pylist()).encode(), np.uint8)
        elif name in ("tags", "hist_cats"):
            values = np.concatenate([column.offsets.to_numpy().astype(np.int64), column.values.to_numpy()])
        else:
            values = column.to_numpy()
        h.update(name.encode())
        h.update(np.ascontiguousarray(values).tobytes())
    return h.hexdigest()


def test_the_columns_that_were_there_are_the_same_for_the_same_seed(tmp_path):
    """Pinned from the generator as it was before watch_time and weight existed (seed 11, 5,000 + 2,000
    rows): their draws come from streams of their own, so the labels and features did not move. A change of
    these hashes changes every data set drawn so far, and the tests that know them."""
    synthesize_multitask(tmp_path, rows=5_000, eval_rows=2_000, seed=11)
    assert _digest(tmp_path / "train.parquet") == "2ada9ece857d67f3322cbc22008312c46822655e1ae86e06ba0ef10d9d2c53d4"
    assert _digest(tmp_path / "eval.parquet") == "ca4b639690fb9a1b78950e9046aabf81842ce3b503aebf2bf59999595a8fcf50"


@pytest.mark.parametrize("rate", ["0", "-0.5", "1.5", "nan"])
def test_the_cli_refuses_a_negative_rate_outside_0_to_1(tmp_path, rate):
    result = CliRunner().invoke(app, ["data", "synth", "--format", "parquet", "--out", str(tmp_path / "x"),
                                      "--rows", "1000", f"--negative-rate={rate}"])
    assert result.exit_code == 2 and "--negative-rate" in result.output, result.output
    assert not (tmp_path / "x").exists()


def test_the_cli_refuses_a_negative_rate_for_tsv(tmp_path):
    result = CliRunner().invoke(app, ["data", "synth", "--out", str(tmp_path / "x"), "--rows", "1000",
                                      "--negative-rate", "0.5"])
    assert result.exit_code == 2 and "--negative-rate" in result.output, result.output


def test_the_cli_down_samples_with_negative_rate(tmp_path):
    result = CliRunner().invoke(app, ["data", "synth", "--format", "parquet", "--out", str(tmp_path), "--rows",
                                      "5000", "--eval-rows", "2000", "--negative-rate", "0.5"])
    assert result.exit_code == 0, result.output
    assert "watch_time oracle RMSE" in result.output and "weight 2" in result.output, result.output
    weights = pq.read_table(tmp_path / "train.parquet").column("weight").to_numpy()
    assert set(np.unique(weights)) == {1.0, 2.0}
    assert (pq.read_table(tmp_path / "eval.parquet").column("weight").to_numpy() == 1.0).all()
    with pytest.raises(ValueError, match="negative_rate"):
        synthesize_multitask(tmp_path / "y", rows=1_000, negative_rate=0.0)
