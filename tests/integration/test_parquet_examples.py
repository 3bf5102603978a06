"""The multi-task Parquet examples (multi-hot tags, a behaviour sequence, two tasks) trained by `hybridrec run`,
one run per example that every test of this module reads: both tasks learn, and their eval rows, served by
feature name, give the run's eval AUC per task — through the inference service's own decoder, batcher and
model in process, through `hybridrec serve inference` from tritonclient over gRPC and REST, and through
`hybridrec predict` on the file; all three agree to 1e-5.

Requests are built from the Parquet columns as a client would send them: a scalar column as one value per
row, a list column as its flat values plus `NAME__lengths`, strings as BYTES and integers as INT64, the dense
columns as one FP32 [batch, num_dense] tensor.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from hybridrec.core.layouts.bundle import read_manifest
from hybridrec.core.config import FeatureKind, load_config
from hybridrec.core.model.evaluation import binary_metrics
from hybridrec.core.config.inference import BatchingConfig
from hybridrec.app.data.synth_parquet import synthesize_multitask
from services.inference.batcher import Batcher
from services.inference.inputs import LENGTHS_SUFFIX, InputDecoder, Tensor
from services.inference.model import StaticSource, load_model
from tests.conftest import HYBRIDREC, REPO
from tests.integration.test_inference import MODEL, Server

pytestmark = pytest.mark.integration

REQUEST_ROWS = 1000


def _cli(args: list[str]) -> None:
    result = subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _ids_tensor(name: str, array: pa.Array) -> Tensor:
    if pa.types.is_integer(array.type):
        values = pc.cast(array, pa.int64()).to_numpy()
        return Tensor(name, "INT64", values.shape, values)
    return Tensor(name, "BYTES", (len(array),), [v.encode() for v in array.to_pylist()])


def requests(path, config, *, dense_by_column: bool) -> list[tuple[list[Tensor], np.ndarray]]:
    """Named-feature requests of REQUEST_ROWS rows each, and their labels (rows, tasks). The dense features go
    as one FP32 [batch, num_dense] tensor, or (`dense_by_column`) as one FP32 [batch] input per column."""
    table = pq.read_table(path)
    out = []
    for start in range(0, table.num_rows, REQUEST_ROWS):
        part = table.slice(start, REQUEST_ROWS)
        columns = [part[c].to_numpy().astype(np.float32) for c in config.dense_columns]
        tensors = ([Tensor(c, "FP32", (part.num_rows,), v) for c, v in zip(config.dense_columns, columns)]
                   if dense_by_column else [Tensor("dense", "FP32", (part.num_rows, config.num_dense),
                                                   np.stack(columns, 1))])
        for feature in config.features:
            column = part[feature.source].combine_chunks()
            if feature.kind == FeatureKind.LIST:  # flat values with lengths; null lists and elements add nothing
                flat = pc.list_flatten(column)
                rows_of = pc.list_parent_indices(column).to_numpy()
                valid = flat.is_valid().to_numpy(zero_copy_only=False)
            else:  # one value per row; a null is sent as a length of 0
                flat, rows_of = column, np.arange(len(column))
                valid = column.is_valid().to_numpy(zero_copy_only=False)
            lengths = np.bincount(rows_of[valid], minlength=part.num_rows).astype(np.int64)
            tensors.append(_ids_tensor(feature.name, flat.filter(pa.array(valid))))
            if feature.kind == FeatureKind.LIST or not valid.all():
                tensors.append(Tensor(feature.name + LENGTHS_SUFFIX, "INT64", lengths.shape, lengths))
        labels = np.stack([part[name].to_numpy().astype(np.float32) for name in config.data.label_names], 1)
        out.append((tensors, labels))
    return out


def serve(bundle, batches) -> np.ndarray:
    model = load_model(bundle)
    decoder = InputDecoder(read_manifest(bundle), REQUEST_ROWS)

    async def go():
        batcher = Batcher(StaticSource(model), BatchingConfig())
        batcher.start()
        try:
            return [(await batcher.infer(decoder.decode(tensors))).probability for tensors, _ in batches]
        finally:
            await batcher.close()
    return np.concatenate(asyncio.run(go())), decoder


def over_the_wire(bundle, batches, tmp_path) -> dict[str, np.ndarray]:
    """Every request to `hybridrec serve inference` on `bundle` through tritonclient's gRPC and HTTP clients
    (tests/integration/oip_named_client.py, a process of its own): named tensors, as a user's client sends them,
    every output the metadata lists asked for by name."""
    server = Server(bundle, tmp_path / "inference.log")
    try:
        return _named_client(server, batches, tmp_path)
    finally:
        server.stop()


def _named_client(server, batches, tmp_path) -> dict[str, np.ndarray]:
    arrays = {}
    for index, (tensors, _) in enumerate(batches):
        for t in tensors:
            arrays[f"{index}/{t.name}"] = (np.array(t.data, dtype=np.bytes_) if t.datatype == "BYTES"
                                           else np.asarray(t.data).reshape(t.shape))
    np.savez(tmp_path / "requests.npz", **arrays)
    result = subprocess.run([sys.executable, str(REPO / "tests/integration/oip_named_client.py"),
                             str(tmp_path / "requests.npz"), server.grpc, server.http, MODEL,
                             str(tmp_path / "answers.npz")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(tmp_path / "answers.npz") as answers:
        return {key: answers[key] for key in answers.files}


@dataclass(frozen=True)
class Trained:
    example: str
    data: Path  # train.parquet, eval.parquet, oracle.json
    run: Path
    summary: dict


@pytest.fixture(scope="module", params=["multitask_parquet", "din_parquet"])
def trained(request, tmp_path_factory) -> Trained:
    """The example trained on 60,000 synthetic rows (20,000 eval rows): every service for real, fp32 pushes
    (fp16 would make the served rows differ from the PS's by its rounding, beyond the 1e-4 asserted below)."""
    example, tmp = request.param, tmp_path_factory.mktemp(request.param)
    data = tmp / "data"
    synthesize_multitask(data, rows=60_000, eval_rows=20_000, seed=2)
    overrides = [f"data.train=[{data / 'train.parquet'}]", f"data.eval=[{data / 'eval.parquet'}]",
                 f"data.oracle={data / 'oracle.json'}", "training.batch_size=2048", "ps.capacity=100000",
                 "cluster.nn_workers=[127.0.0.1:0]", "cluster.ps=[127.0.0.1:0]", "training.compression.fp16=false"]
    args = ["run", f"examples/{example}.yaml", "--run-dir", str(tmp / "run")]
    for item in overrides:
        args += ["--set", item]
    _cli(args)
    return Trained(example, data, tmp / "run", json.loads((tmp / "run" / "summary.json").read_text()))


def test_both_tasks_learn_and_their_oracles_come_through(trained):
    summary = trained.summary
    tasks = {t["name"]: t for t in summary["tasks"]}
    assert set(tasks) == {"click", "conversion"}
    for task in tasks.values():  # learned something, and the oracle of each task came through
        assert task["auc"] > 0.6 and task["oracle_auc"] > task["auc"] - 0.01, task
    assert summary["auc"] == tasks["click"]["auc"]
    assert summary["data"]["train"]["rows"] == 60_000 and summary["data"]["train"]["truncated_rows"] > 0


def test_served_named_features_give_the_runs_eval_auc_per_task(tmp_path, trained):
    example, data, run, summary = trained.example, trained.data, trained.run, trained.summary
    _cli(["export", str(run), "--out", str(tmp_path / "bundle")])
    config = load_config(run / "config.yaml")
    batches = requests(data / "eval.parquet", config, dense_by_column=example == "din_parquet")
    manifest = read_manifest(tmp_path / "bundle")
    types = manifest.input_types  # from the training file's schema: item_id is a string
    assert types == {f.name: "BYTES" if f.source == "item_id" else "INT64" for f in config.features}, types
    assert manifest.dense_columns == ["d0", "d1", "d2", "d3"]
    probs, decoder = serve(tmp_path / "bundle", batches)
    labels = np.concatenate([b[1] for b in batches])
    assert probs.shape == labels.shape == (20_000, 2)
    assert decoder.truncated_rows > 0  # some histories are longer than max_len: cut as in training
    for t, task in enumerate(summary["tasks"]):
        served = binary_metrics(labels[:, t], probs[:, t])["auc"]
        print(f"{example} {task['name']}: served AUC {served:.6f}, run's eval AUC {task['auc']:.6f}")
        assert abs(served - task["auc"]) <= 1e-4, (task["name"], served, task["auc"])

    # The same requests from a stock OIP client (tritonclient) to `hybridrec serve inference`, gRPC and REST.
    wire = over_the_wire(tmp_path / "bundle", batches, tmp_path)
    for kind in ("grpc", "http"):
        np.testing.assert_allclose(wire[kind], probs, rtol=0, atol=1e-5)
        # The metadata names each task as an output of its own: that column of the probabilities.
        assert wire[f"{kind}_outputs"].tolist() == ["probability", "click", "conversion"], wire[f"{kind}_outputs"]
        for t, task in enumerate(("click", "conversion")):
            np.testing.assert_array_equal(wire[f"{kind}/{task}"], wire[kind][:, t])

    # Offline scoring of the same file equals the served predictions.
    _cli(["predict", str(tmp_path / "bundle"), str(data / "eval.parquet"), "--out", str(tmp_path / "p.parquet")])
    offline = pq.read_table(tmp_path / "p.parquet")
    assert offline.column_names == ["click", "conversion"]
    np.testing.assert_allclose(np.stack([offline[c].to_numpy() for c in offline.column_names], 1), probs,
                               rtol=0, atol=1e-5)

    # Data whose columns do not match the bundle: exit 2 naming the column and the file.
    pq.write_table(pq.read_table(data / "eval.parquet").drop_columns(["tags"]), tmp_path / "no_tags.parquet")
    bad = subprocess.run(HYBRIDREC + ["predict", str(tmp_path / "bundle"), str(tmp_path / "no_tags.parquet"),
                                      "--out", str(tmp_path / "bad.csv")], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "no_tags.parquet" in bad.stderr and "'tags'" in bad.stderr, bad.stderr[-2000:]
