"""Synthetic multi-task Parquet data (`hybridrec data synth --format parquet`) drawn from a planted model.

Runs wherever data is prepared, not in a service. Like `synth.py` for TSV,
it exists so that the Parquet path, multi-hot bags, sequences and multi-task
training are judged against a known answer: `oracle.json` records, per task,
the AUC of the true probabilities on the eval file.

Columns (one row group per block of BLOCK_ROWS rows):

| column | type | planted effect |
|---|---|---|
| click, conversion | int8 | the two labels, Bernoulli of each task's probability |
| d0..d3 | float32 | linear, different per task |
| user_id | int64, 5 % null | per-user effect (both tasks) |
| item_id | string | per-item effect; conversion's is correlated with click's |
| item_cat | int64 | the item's category (per-category effect on click) |
| tags | list<int64>, 1..6 | multi-hot interests: sum of tag effects / sqrt(count) |
| hist_cats | list<int64>, 0..40 | behaviour sequence of categories, oldest first |

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
recency embedding (`hybridrec.models.TargetAttention`) can represent both.

**Two correlated tasks**: conversion shares the user, tag and sequence
effects (scaled) with click and has an item effect correlated with click's
(CONV_ITEM_CORR), plus its own dense weights. Per-ID effects taper below
ID_TAPER_FREQ, as in `synth.py`, so that the oracle holds little signal no
model can learn from rare IDs in one epoch.

**A planted drift** (`Drift`, `hybridrec data synth --format parquet --drift-at ROW`): from a training row
on, a few frequent items (the 5th most frequent and the next ones by default, each in 1-3 % of rows) add a
shift to both tasks' logits, as when items suddenly become popular. An item's own effect is in no planted
interaction (the sequence effect depends on its category, which does not change). The eval file is drawn
after the drift, and `drift_probes.parquet` holds rows carrying each drifted item, and as many rows of as many
control items (the next ones in frequency of other categories, unchanged), in the training data's columns: what the inference
service's named inputs take (labels are placeholders, 0, so that `hybridrec predict` reads the file with the
job's config). `oracle.json` records their true probabilities per task before and after the drift.

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

from hybridrec.evaluation import binary_metrics

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
GENERATOR_VERSION = "1"
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
        bias=np.zeros(2))
    logits = _draw(planted, _stream(seed, 3), 100_000)[0]
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
    """(logits without bias (n, 2), columns) of n rows (whose items are `items`, when given)."""
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
    click = user_term + m.item_eff[item] + m.cat_eff[cat] + tag_term + seq_term + dense @ m.dense_click
    conv = 0.7 * user_term + m.item_conv_eff[item] + 0.5 * tag_term + 0.5 * seq_term + dense @ m.dense_conv
    columns = {"user": user, "user_null": user_null, "item": item, "cat": cat, "num_tags": num_tags, "tags": tags,
               "hist_len": hist_len, "hist": hist, "dense": dense}
    return np.stack([click, conv], axis=1), columns


def _table(columns: dict, labels: np.ndarray):
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
    return pa.table(arrays)


def _item_names(items: np.ndarray) -> np.ndarray:
    """Items as the item_id column spells them."""
    return np.char.add("it", np.char.mod("%05x", np.asarray(items)))


def _write(path: Path, m: _Planted, seed: int, file_key: int, rows: int,
           drift: tuple[int, np.ndarray, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Write `rows` rows; returns (labels (rows, 2), true probabilities (rows, 2)). `drift`: (first row it
    applies to, drifted items, shift)."""
    import pyarrow.parquet as pq

    all_labels, all_p = [], []
    writer = None
    try:
        for block, start in enumerate(range(0, rows, BLOCK_ROWS)):
            rng = _stream(seed, file_key, block)
            n = min(BLOCK_ROWS, rows - start)
            logits, columns = _draw(m, rng, n)
            if drift is not None:
                at_row, drifted, shift = drift
                after = np.arange(start, start + n) >= at_row
                logits += np.where(after & np.isin(columns["item"], drifted), shift, 0.0)[:, None]
            p = 1 / (1 + np.exp(-(logits + m.bias)))
            labels = (rng.random(p.shape) < p).astype(np.int8)
            table = _table(columns, labels)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=BLOCK_ROWS)
            all_labels.append(labels)
            all_p.append(p)
    finally:
        if writer is not None:
            writer.close()
    return np.concatenate(all_labels), np.concatenate(all_p)


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
    pq.write_table(_table(columns, np.zeros((len(logits), 2), np.int8)), out / PROBE_FILE)
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


def synthesize_multitask(out_dir: str | os.PathLike, *, rows: int, eval_rows: int | None = None,
                         seed: int = 0, drift: Drift | None = None) -> MultitaskSummary:
    """Write train.parquet, eval.parquet and oracle.json (per task under `tasks`; the top-level oracle_auc
    is click's). `eval_rows` defaults to rows // 10, at least 10,000. With `drift`, also drift_probes.parquet;
    the eval file is drawn after the drift."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    eval_rows = max(rows // 10, 10_000) if eval_rows is None else eval_rows
    if eval_rows <= 0:
        raise ValueError(f"eval_rows must be positive, got {eval_rows}")
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    planted = _build(seed)
    drifted = _plant_drift(out, planted, seed, drift, rows) if drift is not None else None
    shift = (np.asarray(drifted["ranks"]), drift.shift) if drift is not None else None
    train_labels, _ = _write(out / "train.parquet", planted, seed, 1, rows, (drift.at_row, *shift) if shift else None)
    eval_labels, eval_p = _write(out / "eval.parquet", planted, seed, 2, eval_rows, (0, *shift) if shift else None)
    oracle_of = [binary_metrics(eval_labels[:, t], eval_p[:, t]) for t in range(len(TASKS))]
    tasks = {name: {"oracle_auc": round(oracle_of[t]["auc"], 6), "oracle_logloss": round(oracle_of[t]["logloss"], 6),
                    "rate": round(float(train_labels[:, t].mean()), 6)} for t, name in enumerate(TASKS)}
    oracle = {"generator_version": GENERATOR_VERSION, "format": "parquet", "seed": seed, "train_rows": rows,
              "eval_rows": eval_rows, "train_file": "train.parquet", "eval_file": "eval.parquet",
              "oracle_auc": tasks["click"]["oracle_auc"], "tasks": tasks,
              "label_correlation": round(float(np.corrcoef(train_labels.T)[0, 1]), 4),
              "sequence": {"match_p": MATCH_P, "scale": SEQ_SCALE, "decay": SEQ_DECAY, "stale": SEQ_STALE,
                           "max_history": MAX_HISTORY},
              **({"drift": drifted} if drifted is not None else {})}
    oracle_path = out / "oracle.json"
    oracle_path.write_text(json.dumps(oracle, indent=2) + "\n")
    return MultitaskSummary(str(out), str(out / "train.parquet"), str(out / "eval.parquet"), str(oracle_path),
                            {name: t["oracle_auc"] for name, t in tasks.items()}, time.perf_counter() - started,
                            oracle)
