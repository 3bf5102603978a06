"""Unit tests of the synthetic Criteo data generator (hybridrec/app/data/synth.py)."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from hybridrec.app.data.synth import GENERATOR_VERSION, synthesize
from services.dataloader.tsv import NUM_DENSE, NUM_SPARSE, read_criteo

ROWS = 20_000


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    summary = synthesize(out, rows=ROWS, seed=7)
    return out, summary


def read_all(path):
    chunks = list(read_criteo(path, bad_lines="error"))
    assert sum(c.num_bad_lines for c in chunks) == 0
    return {k: np.concatenate([getattr(c, k) for c in chunks])
            for k in ("labels", "dense", "ids", "present")}


def test_files_and_oracle(synth_dir):
    out, summary = synth_dir
    assert summary.train_path == str(out / "train.tsv")
    assert summary.eval_path == str(out / "eval.tsv")
    oracle = json.loads((out / "oracle.json").read_text())
    for key in ("oracle_auc", "oracle_logloss", "train_rows", "eval_rows", "seed", "ctr",
                "cardinalities", "zipf_exponents", "generator_version"):
        assert key in oracle, key
    assert oracle["generator_version"] == GENERATOR_VERSION
    assert oracle["train_rows"] == ROWS and oracle["eval_rows"] == 10_000  # default minimum
    assert oracle["seed"] == 7
    assert 0.6 < oracle["oracle_auc"] < 0.95
    assert 0.15 < oracle["ctr"] < 0.35
    assert 0.2 < oracle["oracle_logloss"] < 0.6
    assert len(oracle["cardinalities"]) == len(oracle["zipf_exponents"]) == NUM_SPARSE
    assert min(oracle["cardinalities"]) == 10 and max(oracle["cardinalities"]) == 1_000_000
    assert all(1.05 <= a <= 1.2 for a in oracle["zipf_exponents"])
    assert oracle["oracle_auc"] == pytest.approx(summary.oracle_auc, abs=1e-6)


def test_readable_and_criteo_like(synth_dir):
    out, summary = synth_dir
    train = read_all(out / "train.tsv")
    evals = read_all(out / "eval.tsv")
    assert len(train["labels"]) == ROWS and len(evals["labels"]) == 10_000
    assert train["labels"].mean() == pytest.approx(summary.ctr, abs=1e-6)
    present = train["present"].mean(0)
    assert present.min() < 0.7 and present.max() > 0.98  # some slots often empty
    assert (train["dense"] == 0).mean() > 0.1  # empty / zero counts
    assert train["dense"].max() > np.log1p(100)  # heavy-tailed counts
    # Zipf: the most frequent token of a big slot covers a visible share of rows
    col = train["ids"][train["present"][:, 0], 0]
    _, counts = np.unique(col, return_counts=True)
    assert counts.max() > 0.01 * len(col)
    line = (out / "train.tsv").read_text().split("\n", 1)[0].split("\t")
    assert len(line) == 1 + NUM_DENSE + NUM_SPARSE
    assert all(re.fullmatch(r"[0-9a-f]{8}|", tok) for tok in line[1 + NUM_DENSE:])
    assert all(re.fullmatch(r"-?[0-9]+|", tok) for tok in line[1:1 + NUM_DENSE])


def test_deterministic(synth_dir, tmp_path):
    out, summary = synth_dir
    again = synthesize(tmp_path / "again", rows=ROWS, seed=7)
    for name in ("train.tsv", "eval.tsv", "oracle.json"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    assert again.oracle_auc == summary.oracle_auc
    other = synthesize(tmp_path / "other", rows=ROWS, eval_rows=12_000, seed=8)
    assert (tmp_path / "other" / "train.tsv").read_bytes() != (out / "train.tsv").read_bytes()
    assert other.eval_rows == 12_000


def test_prefix_stable_and_gzip(synth_dir, tmp_path):
    """A shorter file is a prefix of a longer one; gzip holds the same text."""
    out, _ = synth_dir
    synthesize(tmp_path, rows=5_000, eval_rows=10_000, seed=7, gzip=True)
    short = gzip.decompress((tmp_path / "train.tsv.gz").read_bytes())
    assert short.count(b"\n") == 5_000
    assert (out / "train.tsv").read_bytes().startswith(short)
    assert gzip.decompress((tmp_path / "eval.tsv.gz").read_bytes()) == (out / "eval.tsv").read_bytes()
    assert len(read_all(tmp_path / "train.tsv.gz")["labels"]) == 5_000


def test_argument_checks(tmp_path):
    with pytest.raises(ValueError, match="rows"):
        synthesize(tmp_path, rows=0)


def test_a_planted_drift_changes_the_labels_of_its_ids_from_its_row_on_and_nothing_else(synth_dir, tmp_path):
    """Rows before the drift are the undrifted file's; from `at_row` on, rows holding a drifted ID are clicked
    at about the planted new rate; the probe rows are valid rows carrying each drifted ID."""
    from hybridrec.app.data.synth import Drift

    out, _ = synth_dir
    at = 8_000
    summary = synthesize(tmp_path, rows=ROWS, seed=7, drift=Drift(at_row=at, shift=2.0))
    planted = summary.extra["drift"]
    lines = (tmp_path / "train.tsv").read_bytes().split(b"\n")
    assert lines[:at] == (out / "train.tsv").read_bytes().split(b"\n")[:at]
    undrifted = (out / "train.tsv").read_bytes().split(b"\n")
    column = 1 + NUM_DENSE + planted["slot"]
    ids = {i.encode() for i in planted["ids"]}
    changed = [i for i in range(ROWS) if lines[i] != undrifted[i]]
    assert changed and min(changed) >= at
    # Only the labels of rows holding a drifted ID change.
    assert all(lines[i][1:] == undrifted[i][1:] and lines[i].split(b"\t")[column] in ids for i in changed)
    hits = np.array([line.split(b"\t")[column] in ids for line in lines[:ROWS]])
    labels = np.array([line[:1] == b"1" for line in lines[:ROWS]])
    before, after = labels[:at][hits[:at]].mean(), labels[at:][hits[at:]].mean()
    assert after - before > 0.2, (before, after)
    probes = (tmp_path / planted["probe_file"]).read_bytes().splitlines()
    controls = {i.encode() for i in planted["control_ids"]}
    assert len(controls) == len(ids) and not controls & ids
    assert len(probes) == planted["probe_rows_per_id"] * (len(ids) + len(controls))
    drifted_probes = probes[:planted["probe_rows_per_id"] * len(ids)]
    assert {p.split(b"\t")[column - 1] for p in drifted_probes} == ids  # no label: one column to the left
    assert {p.split(b"\t")[column - 1] for p in probes} == ids | controls
    assert all(p.count(b"\t") == NUM_DENSE + NUM_SPARSE - 1 for p in probes)
    assert all(a > b for a, b in zip(planted["probe_p_after"], planted["probe_p_before"]))
    assert json.loads((tmp_path / "oracle.json").read_text())["drift"] == planted


def test_a_drift_that_cannot_be_planted_names_why(tmp_path):
    from hybridrec.app.data.synth import Drift

    with pytest.raises(ValueError, match="only 1000 rows"):
        synthesize(tmp_path, rows=1_000, eval_rows=1_000, drift=Drift(at_row=1_000))
    with pytest.raises(ValueError, match="slot 26"):
        synthesize(tmp_path, rows=1_000, eval_rows=1_000, drift=Drift(at_row=10, slot=26))


def test_a_planted_drift_in_the_multitask_data_changes_its_items_labels_from_its_row_on(tmp_path):
    """`synth --format parquet --drift-at ROW`: the rows are the undrifted file's; from ROW on, rows holding a
    drifted item get both tasks' labels at the planted new rate; the probe file holds rows of each drifted and
    control item in the training data's columns, and `oracle.json` their true rates per task, before and after."""
    import pyarrow.parquet as pq

    from hybridrec.app.data.synth_parquet import Drift as ItemDrift, synthesize_multitask

    rows, at = 40_000, 20_000
    synthesize_multitask(tmp_path / "plain", rows=rows, eval_rows=10_000, seed=2)
    summary = synthesize_multitask(tmp_path / "drift", rows=rows, eval_rows=10_000, seed=2,
                                   drift=ItemDrift(at_row=at, shift=2.0))
    planted = summary.extra["drift"]
    plain, drifted = (pq.read_table(tmp_path / d / "train.parquet") for d in ("plain", "drift"))
    labels = ("click", "conversion")
    assert plain.drop_columns(list(labels)).equals(drifted.drop_columns(list(labels)))  # the same rows
    items = drifted.column("item_id").to_numpy(zero_copy_only=False)
    hits = np.isin(items, planted["ids"])
    for task in labels:
        a, b = plain.column(task).to_numpy(), drifted.column(task).to_numpy()
        changed = np.flatnonzero(a != b)
        assert changed.min() >= at and hits[changed].all(), task  # only drifted items' rows from the drift on
        assert b[at:][hits[at:]].mean() - b[:at][hits[:at]].mean() > 0.15, task
        assert all(x > y for x, y in zip(planted["probe_p_after"][task], planted["probe_p_before"][task]))
    probes = pq.read_table(tmp_path / "drift" / planted["probe_file"])
    assert probes.schema.names == drifted.schema.names
    per_id = planted["probe_rows_per_id"]
    assert probes.column("item_id").to_pylist() == [i for i in planted["ids"] + planted["control_ids"]
                                                    for _ in range(per_id)]
    assert not set(planted["ids"]) & set(planted["control_ids"]) and planted["column"] == "item_id"
    categories = dict(zip(probes.column("item_id").to_pylist(), probes.column("item_cat").to_pylist()))
    assert not {categories[i] for i in planted["ids"]} & {categories[i] for i in planted["control_ids"]}
    with pytest.raises(ValueError, match="only 40000 rows"):
        synthesize_multitask(tmp_path / "x", rows=rows, drift=ItemDrift(at_row=rows))


def test_ids_gives_the_training_file_about_that_many_distinct_ids(tmp_path):
    """--ids: rare IDs (16 hex digits) drawn beside the large slots' planted ones; the file holds about the
    distinct IDs asked for, the parser reads it, the oracle is the true probabilities' AUC, and the default
    generator's rows are untouched (the tail draws only where it is asked for)."""
    summary = synthesize(tmp_path / "wide", rows=60_000, eval_rows=10_000, seed=7, ids=300_000)
    tail = summary.extra["ids"]
    train = read_all(tmp_path / "wide" / "train.tsv")
    distinct = sum(len(np.unique(train["ids"][train["present"][:, s], s])) for s in range(NUM_SPARSE))
    assert distinct == pytest.approx(300_000, rel=0.05)
    assert tail["target_distinct_ids"] == 300_000 and 0 < tail["tail_share"] <= 0.9
    assert 0.5 < summary.oracle_auc < 1 and summary.ctr == pytest.approx(0.25, abs=0.03)
    lines = (tmp_path / "wide" / "train.tsv").read_text().splitlines()[:200]
    tokens = [tok for line in lines for tok in line.split("\t")[1 + NUM_DENSE:] if tok]
    assert any(len(t) == 16 for t in tokens) and all(re.fullmatch(r"[0-9a-f]{8}|[0-9a-f]{16}", t) for t in tokens)
    wide_slots = set(tail["tail_slots"])
    assert all(len(tok) == 8 for line in lines for s, tok in enumerate(line.split("\t")[1 + NUM_DENSE:])
               if tok and s not in wide_slots)
    again = synthesize(tmp_path / "again", rows=60_000, eval_rows=10_000, seed=7, ids=300_000)
    assert (tmp_path / "again" / "train.tsv").read_bytes() == (tmp_path / "wide" / "train.tsv").read_bytes()
    assert again.oracle_auc == summary.oracle_auc


@pytest.mark.parametrize("ids, says", [(10**9, r"--ids 1,000,000,000: 60,000 training rows hold at most about "
                                                r"[\d,]+ distinct IDs .* raise --rows to at least [\d,]+"),
                                       (10, r"--ids 10: the planted model alone shows about [\d,]+ distinct IDs"),
                                       (2 * 10**9, r"--ids 2,000,000,000: must be in 1..1,000,000,000")])
def test_ids_that_the_rows_cannot_hold_name_the_option_and_the_limit(tmp_path, ids, says):
    with pytest.raises(ValueError, match=says):
        synthesize(tmp_path, rows=60_000, ids=ids)
    assert not (tmp_path / "train.tsv").exists()


def test_a_fixed_tail_share_gives_other_ids_the_same_ids_per_batch(tmp_path):
    """--tail-share: two data sets of 150k and 250k distinct IDs at one share draw as many rare IDs per row, so
    a batch (of 512 rows: far fewer rare IDs than either vocabulary) holds about as many distinct IDs; each file
    holds about the distinct IDs asked for."""
    def per_batch_and_total(ids: int) -> tuple[float, int]:
        synthesize(tmp_path / str(ids), rows=60_000, eval_rows=10_000, seed=7, ids=ids, tail_share=0.5)
        train = read_all(tmp_path / str(ids) / "train.tsv")
        batch = [len(np.unique(train["ids"][:512][train["present"][:512, s], s])) for s in range(NUM_SPARSE)]
        total = sum(len(np.unique(train["ids"][train["present"][:, s], s])) for s in range(NUM_SPARSE))
        return sum(batch), total

    small, small_total = per_batch_and_total(150_000)
    large, large_total = per_batch_and_total(250_000)
    assert small == pytest.approx(large, rel=0.03)
    assert small_total == pytest.approx(150_000, rel=0.05) and large_total == pytest.approx(250_000, rel=0.05)
    with pytest.raises(ValueError, match=r"--ids 10,000,000 with --tail-share 0.5: 60,000 training rows show"):
        synthesize(tmp_path / "x", rows=60_000, ids=10_000_000, tail_share=0.5)
    with pytest.raises(ValueError, match="--tail-share: only with --ids"):
        synthesize(tmp_path / "y", rows=60_000, tail_share=0.5)
