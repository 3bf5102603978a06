"""Unit tests of the synthetic Criteo data generator (hybridrec/app/synth.py)."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from hybridrec.app.synth import GENERATOR_VERSION, synthesize
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
