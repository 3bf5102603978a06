"""Synthetic multi-task Parquet data (`hybridrec data synth --format parquet`) drawn from a planted model.

Runs wherever data is prepared, not in a service. Like `synth.py` for TSV,
it exists so that the Parquet path, multi-hot bags, sequences, multi-task
training, a regression head and weighted training are judged against a known
answer: `oracle.json` records under `tasks`, per binary task, the AUC of the
true probabilities on the eval file, and for the regression label the RMSE and
MAE of its true mean: what a perfect model scores.

Columns (one row group per block of BLOCK_ROWS drawn rows):

| column | type | planted effect |
|---|---|---|
| click, conversion | int8 | the two labels, Bernoulli of each task's probability |
| d0..d3 | float32 | linear, different per task |
| user_id | int64, 5 % null | per-user effect (both tasks) |
| item_id | string | per-item effect; conversion's is correlated with click's |
| item_cat | int64 | the item's category (per-category effect on click) |
| tags | list<int64>, 1..6 | multi-hot interests: sum of tag effects / sqrt(count) |
| hist_cats | list<int64>, 0..40 | behaviour sequence of categories, oldest first |
| watch_time | float32, > 0 | regression label: its true mean times lognormal noise of mean 1 |
| weight | float32 | sample weight: 1, or 1 / negative_rate on kept training negatives |

**The sequence effect needs order and the target.** hist_cats holds the
categories of the user's past items; each element is the target's category
(item_cat) with probability MATCH_P, else a random one. The effect is
SEQ_SCALE * sum over elements equal to item_cat of (SEQ_DECAY ** age -
SEQ_STALE), where age counts back from the newest element (0): a recent match
raises both tasks' odds, an old one lowers them a little. So it depends on the
interaction of each element with the target (a match), and on where in the
sequence the matches sit: the same number of matches can raise or lower the
odds. A sum-pooled history keeps neither the order nor, except blurred into a
sum of every element's embedding, the matches; DIN's target attention with a
recency embedding (`hybridrec.core.model.models.TargetAttention`) can represent both.

**Two correlated tasks**: conversion shares the user, tag and sequence
effects (scaled) with click and has an item effect correlated with click's
(CONV_ITEM_CORR), plus its own dense weights. Per-ID effects taper below
ID_TAPER_FREQ, as in `synth.py`, so that the oracle holds little signal no
model can learn from rare IDs in one epoch.

**A regression label**: watch_time's true mean is exp(WATCH_SHARE * the click logit's user, item, category,
tag and sequence effects + its own dense weights on d0..d3 + a bias that puts its mean at about WATCH_MEAN):
a function of the row's features, as click's probability is, that a DNN on them can learn. The label is that
mean times exp(WATCH_NOISE * z - WATCH_NOISE ** 2 / 2), z standard normal, so the mean is the best
prediction in squared error; oracle.json's `tasks` entry of it records its RMSE and MAE on the eval file,
beside those of the training rows' mean. The noise has random streams of its own, so click, conversion and
every feature are what they were before watch_time existed, for the same seed.

**Sample weights** (`negative_rate`, `hybridrec data synth --format parquet --negative-rate R`): the training
file keeps each row with click == 0 with probability R (a random stream of its own, so the kept rows are the
same rows as without it) and weights them 1 / R; positives keep weight 1. Weighted, the kept rows estimate the
undown-sampled file's means (click rate, watch time); a trainer that ignores the weights learns a click rate
about 1 / (rate + R (1 - rate)) times too high. The eval file is never down-sampled (weight 1), and the
oracle's train-side figures (`rate`, `mean`, label_correlation) are of the drawn rows, before down-sampling.

**A planted drift** (`Drift`, `hybridrec data synth --format parquet --drift-at ROW`): from a training row
on, a few frequent items (the 5th most frequent and the next ones by default, each in 1-3 % of rows) add a
shift to both tasks' logits, as when items suddenly become popular. An item's own effect is in no planted
interaction (the sequence effect depends on its category, which does not change). The eval file is drawn
after the drift, and `drift_probes.parquet` holds rows carrying each drifted item, and as many rows of as many
control items (the next ones in frequency of other categories, unchanged), in the training data's columns: what the inference
service's named inputs take (labels are placeholders, 0, so that `hybridrec predict` reads the file with the
job's config; watch_time 0, weight 1). `oracle.json` records their true probabilities per task before
and after the drift. The drift shifts click and conversion only, not watch_time; --drift-at counts drawn
training rows (before any down-sampling).

Deterministic given the seed; rows are drawn in blocks with their own random
streams, and a drift changes the labels' probabilities only, not the rows.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridrec.core.model.evaluation import binary_metrics

BLOCK_ROWS = 1 << 16
"""Rows per random stream and per row group."""
NUM_USERS, NUM_ITEMS, NUM_CATEGORIES, NUM_TAGS = 20_000, 5_000, 100, 500
NUM_DENSE = 4
MAX_TAGS, MAX_HISTORY = 6, 40
USER_SCALE, ITEM_SCALE, CATEGORY_SCALE, TAG_SCALE = 0.4, 0.4, 0.3, 0.5
ID_TAPER_FREQ = 5e-4
"""IDs rarer than this (probability per row) carry proportionally less signal."""
MATCH_P = 0.15
"""Chance that a history element is the target's category (besides matching by chance)."""
SEQ_SCALE, SEQ_DECAY, SEQ_STALE = 1.5, 0.5, 0.15
"""Sequence effect: SEQ_SCALE * sum of (SEQ_DECAY ** age - SEQ_STALE) over elements matching the target's
category: a recent match attracts, an old one has gone stale and repels a little."""
CONV_ITEM_CORR = 0.6
TARGET_CTR, TARGET_CVR = 0.2, 0.1
TASKS = ("click", "conversion")
"""The binary tasks (labels), in their columns' order; the entries of oracle.json's `tasks` with an oracle_auc."""
REGRESSION_TASKS = ("watch_time",)
"""The regression labels; the entries of oracle.json's `tasks` with an oracle_rmse and oracle_mae."""
WATCH_MEAN, WATCH_SHARE, WATCH_NOISE = 30.0, 0.5, 0.5
"""watch_time: its mean, the share of the click logit's non-dense effects in its log mean, and the sigma of
its lognormal noise (coefficient of variation about 0.53)."""
WEIGHT_COLUMN = "weight"
WATCH_KEY, NEGATIVE_KEY = 5, 6
"""First `_stream` keys of watch_time's noise and of the negatives' down-sampling, after the seed: none of the
other streams' keys (0-4) starts with them, so these draws leave every other column as it was."""
GENERATOR_VERSION = "2"
DRIFT_COLUMN = "item_id"
PROBE_FILE = "drift_probes.parquet"
PROBE_ROWS_PER_ID = 100


@dataclass(frozen=True)
class Drift:
    """From training row `at_row` on, `ids` items (the most frequent from rank `first_rank` on: the 5th and
    after, by default) add `shift` to both tasks' logits."""

    at_row: int
    ids: int = 8
    first_rank: int = 4
    shift: float = 1.5

    def ranks(self) -> np.ndarray:
        """The drifted items' ranks, or ValueError naming the setting that cannot hold."""
        if self.at_row < 0 or self.ids <= 0 or self.first_rank < 0:
            raise ValueError(f"drift: at_row and first_rank must be >= 0 and ids > 0, got {self}")
        if self.first_rank + 2 * self.ids > NUM_ITEMS // 2:
            raise ValueError(f"drift: first_rank + ids drifted + ids control = {self.first_rank + 2 * self.ids} "
                             f"of {NUM_ITEMS} items: drift fewer (controls are later items of other categories)")
        return np.arange(self.first_rank, self.first_rank + self.ids)


@dataclass
class MultitaskSummary:
    """What synthesize_multitask wrote and the per-task oracle of its eval file."""

    out_dir: str
    train_path: str
    eval_path: str
    oracle_path: str
    oracle_auc: dict[str, float]
    seconds: float
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class _Planted:
    user_cdf: np.ndarray
    item_cdf: np.ndarray
    tag_cdf: np.ndarray
    cat_cdf: np.ndarray
    user_eff: np.ndarray
    item_eff: np.ndarray
    item_conv_eff: np.ndarray
    item_cat: np.ndarray
    cat_eff: np.ndarray
    tag_eff: np.ndarray
    dense_click: np.ndarray
    dense_conv: np.ndarray
    bias: np.ndarray  # (2,) per task
    dense_watch: np.ndarray
    watch_bias: float = 0.0  # log-mean offset, calibrated so watch_time's mean is about WATCH_MEAN


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, 7, *key]))


def _zipf(n: int, exponent: float) -> tuple[np.ndarray, np.ndarray]:
    pmf = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    pmf /= pmf.sum()
    return np.cumsum(pmf), pmf


def _effects(rng: np.random.Generator, pmf: np.ndarray, scale: float) -> np.ndarray:
    """Gaussian per-ID effects, tapered below ID_TAPER_FREQ, rescaled to a row-weighted std of `scale`."""
    eff = rng.standard_normal(pmf.shape[0]) * np.minimum(1.0, np.sqrt(pmf / ID_TAPER_FREQ))
    return eff * (scale / math.sqrt(pmf @ eff ** 2))


def _build(seed: int) -> _Planted:
    rng = _stream(seed, 0)
    user_cdf, user_pmf = _zipf(NUM_USERS, 1.05)
    item_cdf, item_pmf = _zipf(NUM_ITEMS, 1.1)
    tag_cdf, tag_pmf = _zipf(NUM_TAGS, 1.0)
    cat_cdf, cat_pmf = _zipf(NUM_CATEGORIES, 0.8)
    item_eff = _effects(rng, item_pmf, ITEM_SCALE)
    own = _effects(rng, item_pmf, ITEM_SCALE)
    planted = _Planted(
        user_cdf=user_cdf, item_cdf=item_cdf, tag_cdf=tag_cdf, cat_cdf=cat_cdf,
        user_eff=_effects(rng, user_pmf, USER_SCALE), item_eff=item_eff,
        item_conv_eff=CONV_ITEM_CORR * item_eff + math.sqrt(1 - CONV_ITEM_CORR ** 2) * own,
        item_cat=np.searchsorted(cat_cdf, rng.random(NUM_ITEMS), side="right").clip(0, NUM_CATEGORIES - 1),
        cat_eff=_effects(rng, cat_pmf, CATEGORY_SCALE), tag_eff=rng.standard_normal(NUM_TAGS) * TAG_SCALE,
        dense_click=np.array([0.3, -0.2, 0.1, 0.0]), dense_conv=np.array([0.2, 0.0, -0.3, 0.2]),
        bias=np.zeros(2), dense_watch=np.array([0.0, 0.25, 0.2, -0.3]))
    logits, sample = _draw(planted, _stream(seed, 3), 100_000)
    planted.watch_bias = math.log(WATCH_MEAN / float(np.mean(np.exp(sample["watch_log"]))))
    for t, target in enumerate((TARGET_CTR, TARGET_CVR)):  # calibrate each task's bias on a sample
        lo, hi = -10.0, 10.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(logits[:, t] + mid)))) < target else (lo, mid)
        planted.bias[t] = (lo + hi) / 2
    return planted


def _draw_ids(cdf: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), cdf.shape[0] - 1)


def _draw(m: _Planted, rng: np.random.Generator, n: int, items: np.ndarray | None = None):
    """(logits without bias (n, 2), columns) of n rows (whose items are `items`, when given). Draws nothing
    for watch_time: its noise comes from a stream of its own (`_watch_time`)."""
    user = _draw_ids(m.user_cdf, rng, n)
    user_null = rng.random(n) < 0.05
    item = _draw_ids(m.item_cdf, rng, n)
    if items is not None:
        item = np.asarray(items)
    cat = m.item_cat[item]
    num_tags = rng.integers(1, MAX_TAGS + 1, n)
    tags = _draw_ids(m.tag_cdf, rng, int(num_tags.sum()))
    tag_row = np.repeat(np.arange(n), num_tags)
    tag_term = np.bincount(tag_row, weights=m.tag_eff[tags], minlength=n) / np.sqrt(num_tags)
    hist_len = rng.integers(0, MAX_HISTORY + 1, n)
    total = int(hist_len.sum())
    hist_row = np.repeat(np.arange(n), hist_len)
    hist = np.where(rng.random(total) < MATCH_P, cat[hist_row], _draw_ids(m.cat_cdf, rng, total))
    age = np.repeat(np.cumsum(hist_len), hist_len) - 1 - np.arange(total)  # 0: the newest element
    seq_term = SEQ_SCALE * np.bincount(hist_row, weights=(hist == cat[hist_row]) * (SEQ_DECAY ** age - SEQ_STALE),
                                       minlength=n)
    dense = rng.standard_normal((n, NUM_DENSE))
    user_term = np.where(user_null, 0.0, m.user_eff[user])
    shared = user_term + m.item_eff[item] + m.cat_eff[cat] + tag_term + seq_term
    click = shared + dense @ m.dense_click  # the same sums, in the same order, as before watch_time
    conv = 0.7 * user_term + m.item_conv_eff[item] + 0.5 * tag_term + 0.5 * seq_term + dense @ m.dense_conv
    columns = {"user": user, "user_null": user_null, "item": item, "cat": cat, "num_tags": num_tags, "tags": tags,
               "hist_len": hist_len, "hist": hist, "dense": dense,
               "watch_log": WATCH_SHARE * shared + dense @ m.dense_watch}  # watch_time's log mean, less watch_bias
    return np.stack([click, conv], axis=1), columns


def _table(columns: dict, labels: np.ndarray, watch_time: np.ndarray, weight: np.ndarray):
    """The file's columns; watch_time and weight come last, so the other columns keep their places."""
    import pyarrow as pa

    def lists(lengths, values):
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int64)))

    arrays = {"click": pa.array(labels[:, 0].astype(np.int8)), "conversion": pa.array(labels[:, 1].astype(np.int8))}
    for j in range(NUM_DENSE):
        arrays[f"d{j}"] = pa.array(columns["dense"][:, j].astype(np.float32))
    arrays["user_id"] = pa.array(columns["user"].astype(np.int64), mask=columns["user_null"])
    arrays["item_id"] = pa.array(_item_names(columns["item"]))
    arrays["item_cat"] = pa.array(columns["cat"].astype(np.int64))
    arrays["tags"] = lists(columns["num_tags"], columns["tags"])
    arrays["hist_cats"] = lists(columns["hist_len"], columns["hist"])
    arrays["watch_time"] = pa.array(watch_time.astype(np.float32))
    arrays[WEIGHT_COLUMN] = pa.array(weight.astype(np.float32))
    return pa.table(arrays)


def _item_names(items: np.ndarray) -> np.ndarray:
    """Items as the item_id column spells them."""
    return np.char.add("it", np.char.mod("%05x", np.asarray(items)))


@dataclass
class _Written:
    """What _write drew, for every drawn row (kept or not): labels (rows, 2), true probabilities (rows, 2),
    watch_time as the file holds it and its true mean; and how many rows the file holds."""

    labels: np.ndarray
    p: np.ndarray
    watch_time: np.ndarray
    watch_mean: np.ndarray
    rows_written: int

    @staticmethod
    def concat(parts: list[_Written]) -> _Written:
        joined = [np.concatenate([getattr(part, name) for part in parts])
                  for name in ("labels", "p", "watch_time", "watch_mean")]
        return _Written(*joined, sum(part.rows_written for part in parts))


def _watch_time(m: _Planted, columns: dict, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(watch_time as the file holds it, float32; its true mean): the mean times lognormal noise of mean 1,
    so that the true mean is the best prediction in squared error; finite and > 0."""
    mean = np.exp(columns["watch_log"] + m.watch_bias)
    noise = np.exp(WATCH_NOISE * rng.standard_normal(mean.shape[0]) - WATCH_NOISE ** 2 / 2)
    return (mean * noise).astype(np.float32), mean


def _sample_negatives(click: np.ndarray, rng: np.random.Generator,
                      negative_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, every row's weight): each positive at weight 1, each negative with probability
    `negative_rate` at weight 1 / negative_rate, so that weighted means over the kept rows estimate the means
    over all of them."""
    positive = click == 1
    keep = positive | (rng.random(click.shape[0]) < negative_rate)
    return keep, np.where(positive, 1.0, 1.0 / negative_rate)


def _block(m: _Planted, seed: int, file_key: int, block: int, start: int, n: int,
           drift: tuple[int, np.ndarray, float] | None, negative_rate: float | None):
    """(the block's table, down-sampled when `negative_rate` is given; what was drawn for its n rows)."""
    rng = _stream(seed, file_key, block)
    logits, columns = _draw(m, rng, n)
    if drift is not None:
        at_row, drifted, shift = drift
        after = np.arange(start, start + n) >= at_row
        logits += np.where(after & np.isin(columns["item"], drifted), shift, 0.0)[:, None]
    p = 1 / (1 + np.exp(-(logits + m.bias)))
    labels = (rng.random(p.shape) < p).astype(np.int8)
    watch_time, watch_mean = _watch_time(m, columns, _stream(seed, WATCH_KEY, file_key, block))
    keep, weight = np.ones(n, bool), np.ones(n)
    if negative_rate is not None:
        keep, weight = _sample_negatives(labels[:, 0], _stream(seed, NEGATIVE_KEY, file_key, block), negative_rate)
    table = _table(columns, labels, watch_time, weight)
    if not keep.all():
        table = table.filter(keep)
    return table, _Written(labels, p, watch_time, watch_mean, table.num_rows)


def _write(path: Path, m: _Planted, seed: int, file_key: int, rows: int,
           drift: tuple[int, np.ndarray, float] | None = None, negative_rate: float | None = None) -> _Written:
    """Draw `rows` rows and write them, or (`negative_rate`) the positives and a share of the negatives.
    `drift`: (first drawn row it applies to, drifted items, shift)."""
    import pyarrow.parquet as pq

    parts = []
    writer = None
    try:
        for block, start in enumerate(range(0, rows, BLOCK_ROWS)):
            table, part = _block(m, seed, file_key, block, start, min(BLOCK_ROWS, rows - start), drift,
                                 negative_rate)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=BLOCK_ROWS)
            parts.append(part)
    finally:
        if writer is not None:
            writer.close()
    return _Written.concat(parts)


def _plant_drift(out: Path, m: _Planted, seed: int, drift: Drift, rows: int) -> dict:
    """Write the drift's probe rows; returns what oracle.json records of it: per task, each probe item's mean
    true probability over its rows, before the drift and after it."""
    import pyarrow.parquet as pq

    if drift.at_row >= rows:
        raise ValueError(f"drift at row {drift.at_row}: the training file has only {rows} rows")
    drifted = drift.ranks()
    # The next items in frequency whose category no drifted item has: a model that moved a drifted item's
    # category (shared by other items) would move these too, and they could not tell a drift learnt per item
    # from one learnt per category.
    later = np.arange(drifted[-1] + 1, NUM_ITEMS)
    control = later[~np.isin(m.item_cat[later], m.item_cat[drifted])][:len(drifted)]
    items = np.concatenate([drifted, control])
    logits, columns = _draw(m, _stream(seed, 4), PROBE_ROWS_PER_ID * len(items), np.repeat(items, PROBE_ROWS_PER_ID))
    n = len(logits)
    pq.write_table(_table(columns, np.zeros((n, 2), np.int8), np.zeros(n), np.ones(n)), out / PROBE_FILE)
    shifts = np.repeat(np.where(np.arange(len(items)) < len(drifted), drift.shift, 0.0), PROBE_ROWS_PER_ID)
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    per_id = lambda p: p.reshape(len(items), PROBE_ROWS_PER_ID, 2).mean(1)  # noqa: E731
    before, after = per_id(sigmoid(logits + m.bias)), per_id(sigmoid(logits + m.bias + shifts[:, None]))
    n = len(drifted)
    rounded = lambda a: [round(float(x), 6) for x in a]  # noqa: E731
    return {"at_row": drift.at_row, "column": DRIFT_COLUMN, "ranks": drifted.tolist(),
            "ids": _item_names(drifted).tolist(), "shift": drift.shift,
            "share_of_rows": round(float(np.diff(m.item_cdf, prepend=0.0)[drifted].sum()), 6),
            "probe_file": PROBE_FILE, "probe_rows_per_id": PROBE_ROWS_PER_ID,
            "probe_p_before": {task: rounded(before[:n, t]) for t, task in enumerate(TASKS)},
            "probe_p_after": {task: rounded(after[:n, t]) for t, task in enumerate(TASKS)},
            "control_ids": _item_names(control).tolist(),
            "control_p": {task: rounded(before[n:, t]) for t, task in enumerate(TASKS)}}


def _check_negative_rate(negative_rate: float | None) -> None:
    if negative_rate is not None and not 0 < negative_rate <= 1:  # NaN fails too
        raise ValueError(f"negative_rate must be in (0, 1], got {negative_rate}")


def _binary_tasks(train: _Written, eval_: _Written) -> dict:
    """oracle.json's `tasks` of the binary tasks: per task, the true probabilities' AUC and log loss on the
    eval file, and the label's rate in the drawn training rows and in the eval file."""
    tasks = {}
    for t, name in enumerate(TASKS):
        metrics = binary_metrics(eval_.labels[:, t], eval_.p[:, t])
        tasks[name] = {"oracle_auc": round(metrics["auc"], 6), "oracle_logloss": round(metrics["logloss"], 6),
                       "rate": round(float(train.labels[:, t].mean()), 6),
                       "eval_rate": round(float(eval_.labels[:, t].mean()), 6), "kind": "binary"}
    return tasks


def _regression_tasks(train: _Written, eval_: _Written) -> dict:
    """oracle.json's `tasks` entry of watch_time: its RMSE and MAE on the eval file of its true mean (what a
    perfect model scores), beside those of the drawn training rows' mean (a model that learnt no feature)."""
    label = eval_.watch_time.astype(np.float64)
    mean = float(np.mean(train.watch_time, dtype=np.float64))
    rmse = lambda error: round(float(np.sqrt(np.mean(error ** 2))), 6)  # noqa: E731
    mae = lambda error: round(float(np.mean(np.abs(error))), 6)  # noqa: E731
    return {"watch_time": {"oracle_rmse": rmse(label - eval_.watch_mean), "oracle_mae": mae(label - eval_.watch_mean),
                           "mean": round(mean, 6), "eval_mean": round(float(label.mean()), 6),
                           "mean_rmse": rmse(label - mean), "mean_mae": mae(label - mean), "kind": "regression"}}


def synthesize_multitask(out_dir: str | os.PathLike, *, rows: int, eval_rows: int | None = None,
                         seed: int = 0, drift: Drift | None = None,
                         negative_rate: float | None = None) -> MultitaskSummary:
    """Write train.parquet, eval.parquet and oracle.json (per task under `tasks`: oracle_auc of click and
    conversion, oracle_rmse and oracle_mae of watch_time; the top-level oracle_auc is click's). `eval_rows`
    defaults to rows // 10, at least 10,000. With `drift`, also drift_probes.parquet; the eval file is drawn
    after the drift. With `negative_rate` (0 < R <= 1), the training file keeps a share R of the `rows` drawn
    rows whose click is 0, at weight 1 / R."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    eval_rows = max(rows // 10, 10_000) if eval_rows is None else eval_rows
    if eval_rows <= 0:
        raise ValueError(f"eval_rows must be positive, got {eval_rows}")
    _check_negative_rate(negative_rate)
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    planted = _build(seed)
    drifted = _plant_drift(out, planted, seed, drift, rows) if drift is not None else None
    shift = (np.asarray(drifted["ranks"]), drift.shift) if drift is not None else None
    train = _write(out / "train.parquet", planted, seed, 1, rows, (drift.at_row, *shift) if shift else None,
                   negative_rate)
    eval_ = _write(out / "eval.parquet", planted, seed, 2, eval_rows, (0, *shift) if shift else None)
    tasks = {**_binary_tasks(train, eval_), **_regression_tasks(train, eval_)}
    oracle = {"generator_version": GENERATOR_VERSION, "format": "parquet", "seed": seed, "train_rows": rows,
              "eval_rows": eval_rows, "train_file": "train.parquet", "eval_file": "eval.parquet",
              "oracle_auc": tasks["click"]["oracle_auc"], "tasks": tasks,
              "label_correlation": round(float(np.corrcoef(train.labels.T)[0, 1]), 4),
              "sequence": {"match_p": MATCH_P, "scale": SEQ_SCALE, "decay": SEQ_DECAY, "stale": SEQ_STALE,
                           "max_history": MAX_HISTORY},
              "watch_time": {"mean": WATCH_MEAN, "share": WATCH_SHARE, "noise_sigma": WATCH_NOISE,
                             "dense": planted.dense_watch.tolist()},
              "weight_column": WEIGHT_COLUMN, "negative_rate": negative_rate, "train_rows_written": train.rows_written,
              **({"drift": drifted} if drifted is not None else {})}
    oracle_path = out / "oracle.json"
    oracle_path.write_text(json.dumps(oracle, indent=2) + "\n")
    return MultitaskSummary(str(out), str(out / "train.parquet"), str(out / "eval.parquet"), str(oracle_path),
                            {name: tasks[name]["oracle_auc"] for name in TASKS}, time.perf_counter() - started,
                            oracle)
