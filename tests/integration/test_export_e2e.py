"""Train, export, predict from the bundle alone: the bundle's predictions reproduce the run's eval AUC."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from hybridrec.core.layouts.bundle import load_dense, open_bundle
from hybridrec.core.config import load_config
from hybridrec.core.model.evaluation import binary_metrics
from hybridrec.core.model.models import FeatureInfo, build_model
from services.dataloader.batching import ReadCounters, iter_rows
from hybridrec.core.layouts.criteo_format import feature_columns
from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration


def _cli(args, timeout=300):
    result = subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def predict(bundle, eval_files, config) -> tuple[np.ndarray, np.ndarray]:
    """Click probabilities of every eval row, from the bundle alone (sum pooling of one ID per field)."""
    manifest, table = open_bundle(bundle)
    model = build_model(manifest.model.path, [FeatureInfo(f.name, f.dim) for f in manifest.features],
                        manifest.num_dense, manifest.model.kwargs)
    model.load_state_dict(load_dense(bundle))
    model.eval()
    columns, groups = feature_columns(config.features)
    probs, labels = [], []
    for rows in iter_rows(eval_files, columns=columns, groups=groups, chunk_rows=8192, bad_lines="skip",
                          counters=ReadCounters()):
        pooled = {}
        ids, present = rows.bags.to_columns()  # one ID or none per field
        for f, feature in enumerate(manifest.features):
            found = table.lookup(feature.dim, np.ascontiguousarray(ids[:, f]))
            pooled[feature.name] = torch.from_numpy(found * present[:, f, None])  # an empty field: empty bag
        with torch.no_grad():
            logits = model(torch.from_numpy(np.array(rows.dense)), pooled).reshape(-1)
        probs.append(torch.sigmoid(logits).numpy())
        labels.append(rows.labels)
    return np.concatenate(probs), np.concatenate(labels)


def test_exported_bundle_reproduces_the_runs_eval_auc(tmp_path, exported_run):
    summary, data, bundle = exported_run.summary, exported_run.data, exported_run.bundle
    assert summary["checkpoint"] and summary["checkpoint_s"] > 0
    manifest, _ = open_bundle(bundle)
    assert manifest.step == summary["steps"] and manifest.num_shards == 2
    probs, labels = predict(bundle, [str(data / "eval.tsv")], load_config(exported_run.config))
    assert labels.shape[0] == summary["eval_samples"] == 10_000
    auc = binary_metrics(labels, probs)["auc"]
    assert abs(auc - summary["auc"]) < 0.002, (auc, summary["auc"])

    # hybridrec predict on the TSV (CSV out): the same probabilities as the bundle read by hand.
    _cli(["predict", str(bundle), str(data / "eval.tsv"), "--out", str(tmp_path / "p.csv")])
    offline = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1, dtype=np.float32)
    assert (tmp_path / "p.csv").read_text().splitlines()[0] == '"probability"'
    np.testing.assert_allclose(offline, probs, rtol=0, atol=1e-5)


def test_an_int8_export_scores_within_0_002_auc_of_the_float32_one_from_tables_3_5x_smaller(tmp_path, exported_run):
    """`hybridrec export --quantize int8` of the same run: `hybridrec predict` reads it (dequantized), its eval AUC
    is within 0.002 of the float32 bundle's, and its tables (rows and scales) are at least 3.5x smaller at
    width 16."""
    from hybridrec.core.layouts.bundle import read_manifest

    data, bundle, config = exported_run.data, exported_run.bundle, load_config(exported_run.config)
    quantized = tmp_path / "int8"
    _cli(["export", str(exported_run.run_dir), "--out", str(quantized), "--quantize", "int8"])
    full, small = read_manifest(bundle), read_manifest(quantized)
    assert small.quantization == "int8" and small.rows == full.rows
    probs, labels = predict(bundle, [str(data / "eval.tsv")], config)
    probs8, labels8 = predict(quantized, [str(data / "eval.tsv")], config)
    np.testing.assert_array_equal(labels, labels8)
    assert abs(binary_metrics(labels, probs8)["auc"] - binary_metrics(labels, probs)["auc"]) < 0.002
    _cli(["predict", str(quantized), str(data / "eval.tsv"), "--out", str(tmp_path / "p8.csv")])
    offline = np.loadtxt(tmp_path / "p8.csv", delimiter=",", skiprows=1, dtype=np.float32)
    np.testing.assert_allclose(offline, probs8, rtol=0, atol=1e-5)
    table_bytes = {name: sum(e.bytes for rel, e in m.files.items() if rel.endswith((".rows.npy", ".scales.npy")))
                   for name, m in (("float32", full), ("int8", small))}
    assert {f.dim for f in full.features} == {16}
    assert table_bytes["float32"] / table_bytes["int8"] >= 3.5, table_bytes
