"""benchmarks/baselines.py: single-process PyTorch and TorchRec baselines learn on tiny synthetic data."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_module():
    spec = importlib.util.spec_from_file_location("hybridrec_bench_baselines", ROOT / "benchmarks" / "baselines.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is created
    spec.loader.exec_module(mod)
    return mod


baselines = _load_module()

# Small tables and batches keep this fast; 30 steps of 512 is enough to learn (AUC ~0.75 here).
SMALL = dict(batch_size=512, max_steps=30, table_rows=50_000, threads=1, curve_points=1, seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hybridrec.app.data.synth import synthesize

    out = tmp_path_factory.mktemp("baselines-synth")
    s = synthesize(out, rows=20000, eval_rows=5000, seed=1)
    return [s.train_path], [s.eval_path]


def _check(res, name: str) -> None:
    assert res.name == name
    assert res.samples == SMALL["batch_size"] * SMALL["max_steps"] and res.steps == SMALL["max_steps"]
    assert res.samples_per_sec > 0 and res.train_wall_s > 0
    assert res.auc > 0.55, res
    assert 0 < res.logloss < 0.69, res  # better than a coin
    assert len(res.curve) == 2 and res.curve[-1] == (res.train_wall_s, res.auc)
    assert 0 < res.curve[0][0] <= res.curve[1][0]
    json.dumps(res.to_json())


def test_jagged_is_feature_major():
    rng = np.random.default_rng(0)
    idx = torch.from_numpy(rng.integers(0, 100, (5, 26)))
    present = torch.from_numpy(rng.random((5, 26)) < 0.7)
    values, lengths = baselines.jagged(idx, present)
    want_values = [int(idx[b, f]) for f in range(26) for b in range(5) if present[b, f]]
    want_lengths = [int(present[b, f]) for f in range(26) for b in range(5)]
    assert values.tolist() == want_values and lengths.tolist() == want_lengths


def test_hashing_trick_maps_ids_into_the_tables():
    a = baselines.Arrays(labels=np.zeros(2, np.float32), dense=np.zeros((2, 13), np.float32),
                         ids=np.array([[(3 << 56) | 1234567] * 26, [2**64 - 1] * 26], np.uint64),
                         present=np.ones((2, 26), bool))
    t = baselines.to_tensors(a, 1000)
    assert t.idx.dtype == torch.int64
    assert t.idx[0, 0] == ((3 << 56) | 1234567) % 1000 and t.idx[1, 0] == (2**64 - 1) % 1000


def test_pytorch_baseline_learns(tiny):
    res = baselines.run_pytorch(*tiny, **SMALL)
    _check(res, "pytorch")
    assert torch.get_num_threads() >= 1


def test_pytorch_model_is_hybridrecs_dnn():
    from hybridrec.core.model.models import DNN

    m = baselines.EmbeddingBagDNN(100, 16, (512, 256, 128))
    assert type(m.dnn) is DNN and m.dnn.names == baselines.FEATURES
    assert [x.out_features for x in m.dnn.net if isinstance(x, torch.nn.Linear)] == [512, 256, 128, 1]
    assert m.dnn.net[0].in_features == 13 + 26 * 16
    assert all(t.sparse and t.mode == "sum" for t in m.tables)
    # a missing feature is an empty bag: zero vector
    idx = torch.zeros(2, 26, dtype=torch.int64)
    present = torch.zeros(2, 26, dtype=torch.bool)
    present[0] = True
    assert m(torch.zeros(2, 13), idx, present).shape == (2,)


def test_cli_writes_json(tiny, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.tsv").symlink_to(tiny[0][0])
    (data / "eval.tsv").symlink_to(tiny[1][0])
    out = tmp_path / "out" / "baselines.json"
    assert baselines.main(["--data", str(data), "--which", "pytorch", "--max-steps", "3", "--batch-size", "512",
                           "--table-rows", "1000", "--threads", "1", "--curve-points", "0",
                           "--out", str(out)]) == 0
    got = json.loads(out.read_text())["baselines"]["pytorch"]
    assert got["samples"] == 1536 and got["samples_per_sec"] > 0 and 0 <= got["auc"] <= 1


def test_baselines_read_prepared_data_as_the_tsv(tiny, tmp_path):
    """`--prepared DIR` (train/ and eval/ from `hybridrec data prepare`) gives the very arrays of the TSV."""
    from benchmarks.baseline_data import load
    from hybridrec.app.cli import app
    from typer.testing import CliRunner

    prepared = tmp_path / "prepared"
    for name, paths in (("train", tiny[0]), ("eval", tiny[1])):
        result = CliRunner().invoke(app, ["data", "prepare", *paths, "--out", str(prepared / name)])
        assert result.exit_code == 0, result.output
    for tsv, directory in ((tiny[0], prepared / "train"), (tiny[1], prepared / "eval")):
        a, b = load(tsv, cache=False), load([str(directory)], cache=False)
        for key in ("labels", "dense", "ids", "present"):
            np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
    out = tmp_path / "out.json"
    assert baselines.main(["--data", str(tmp_path), "--prepared", str(prepared), "--which", "pytorch",
                           "--max-steps", "2", "--batch-size", "512", "--table-rows", "1000", "--threads", "1",
                           "--curve-points", "0", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["baselines"]["pytorch"]["samples"] == 1024


def test_torchrec_baseline_learns(tiny):
    ok, why = baselines.torchrec_available()
    if not ok:
        pytest.skip(f"torchrec cannot be imported: {why}")
    res = baselines.run_torchrec(*tiny, **SMALL)
    _check(res, "torchrec")
    # the fused FBGEMM table-batched kernel with the optimizer in backward, not dense table gradients
    assert any("SplitTableBatchedEmbeddingBagsCodegen" in k for k in res.details["kernels"]), res.details
    assert "Adagrad" in res.details["embedding_optimizer"]
    import torch.distributed as dist

    assert not dist.is_initialized()  # the 1-rank group it made is gone
