"""The inference service's dense forward in ONNX Runtime (services/inference/compiled.py): every example model
answers as PyTorch does, eagerly, and a model the export would get wrong is served eagerly instead."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from hybridrec.core.config import FeatureKind
from hybridrec.core.model.pooling import PooledEmbeddings
from services.inference.compiled import CompiledDense
from services.inference.inputs import InputDecoder, Tensor
from services.inference.model import load_model
from tests.conftest import REPO
from tests.inference_util import make_config_bundle

VOCABULARY = 500


def _config(tmp_path, example: str, model: dict | None = None):
    tree = yaml.safe_load((REPO / "examples" / example).read_text())
    if model is not None:
        tree["model"] = model
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _named_request(manifest, rows: int, seed: int) -> list[Tensor]:
    """`rows` samples by feature name: known and unknown integers, list features from empty to longer than
    their max_len (cut to their most recent values, as in training)."""
    rng = np.random.default_rng(seed)
    tensors = [Tensor("dense", "FP32", (rows, manifest.num_dense),
                      rng.normal(0, 1, rows * manifest.num_dense).astype(np.float32))]
    for feature in manifest.features:
        if feature.kind == FeatureKind.LIST:
            lengths = rng.integers(0, feature.max_len + 3, rows)
            values = rng.integers(0, 2 * VOCABULARY, int(lengths.sum()))
            tensors += [Tensor(feature.name, "INT64", values.shape, values),
                        Tensor(feature.name + "__lengths", "INT64", lengths.shape, lengths)]
        else:
            values = rng.integers(0, 2 * VOCABULARY, rows)
            tensors.append(Tensor(feature.name, "INT64", values.shape, values))
    return tensors


def _forward(model, tensors: list[Tensor]) -> np.ndarray:
    samples = InputDecoder(model.manifest, 4096).decode(tensors)
    uniq, bags = model.pooler.from_bags(samples.bags)
    bags.rows = {dim: model.table.table.lookup(dim, ids) for dim, ids in uniq.items()}
    return model.forward(np.ascontiguousarray(samples.dense), bags)


@pytest.mark.parametrize("example, model", [
    ("criteo_synth.yaml", None),
    ("criteo_synth.yaml", {"path": "hybridrec.models:DLRM", "kwargs": {"bottom": [32, 16], "top": [64, 32]}}),
    ("din_parquet.yaml", None),
    ("multitask_parquet.yaml", None),
], ids=["dnn", "dlrm", "din", "mmoe"])
def test_every_example_model_answers_as_pytorch_does(tmp_path, example, model):
    make_config_bundle(tmp_path / "bundle", _config(tmp_path, example, model), vocabulary=VOCABULARY)
    eager = load_model(tmp_path / "bundle")
    compiled = load_model(tmp_path / "bundle", compile=True)
    assert eager.compiled is None and compiled.compiled is not None
    for rows, seed in ((1, 0), (16, 1), (300, 2)):
        tensors = _named_request(eager.manifest, rows, seed)
        want, got = _forward(eager, tensors), _forward(compiled, tensors)
        assert got.shape == want.shape and got.dtype == np.float32
        assert want.shape[0] == rows and np.isfinite(want).all() and (rows == 1 or want.std() > 1e-3)  # not vacuous
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


class _BakesAValue(torch.nn.Module):
    """A model whose answer hangs on a Python number taken from its input: the export freezes the value it
    saw, so the compiled graph would answer other inputs wrongly."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, dense, embeddings):
        scale = float(dense.abs().sum())
        return (self.linear(dense) * scale).squeeze(-1)


def test_a_model_the_export_would_get_wrong_is_served_eagerly(tmp_path, capsys):
    model = load_model(_bundle_of(tmp_path, "din_parquet.yaml"))
    _, pooled = model.pooler.pool(_probe_bags(model), torch.device("cpu"), grad=False)
    assert CompiledDense.build(_BakesAValue().eval(), pooled, 4) is None
    logged = capsys.readouterr()
    assert "dense_forward_eager" in logged.out + logged.err
    assert CompiledDense.build(model.model, pooled, 4, precision="bf16") is None  # answered under autocast
    assert CompiledDense.build(model.model, pooled, 4) is not None


def _bundle_of(tmp_path, example: str):
    make_config_bundle(tmp_path / "bundle", _config(tmp_path, example), vocabulary=VOCABULARY)
    return tmp_path / "bundle"


def _probe_bags(model):
    samples = InputDecoder(model.manifest, 4096).decode(_named_request(model.manifest, 2, 0))
    uniq, bags = model.pooler.from_bags(samples.bags)
    bags.rows = {dim: model.table.table.lookup(dim, ids) for dim, ids in uniq.items()}
    return bags


def test_scalar_columns_are_looked_up_as_they_are_and_answer_as_the_pooled_path(tmp_path):
    """The README model's requests (`ids`: one ID or none per feature; known, unknown and absent ones) go
    through `forward_columns`, alone and merged, and answer as the reference forward pass does."""
    import asyncio

    from hybridrec.core.config.inference import BatchingConfig
    from services.inference.batcher import Batcher
    from services.inference.model import StaticSource
    from tests.inference_util import make_bundle, random_ids, reference

    _, known = make_bundle(tmp_path / "b")
    model = load_model(tmp_path / "b", compile=True)
    (tmp_path / "din").mkdir()
    assert model.takes_columns and not load_model(_bundle_of(tmp_path / "din", "din_parquet.yaml"),
                                                  compile=True).takes_columns
    ids = random_ids(known, 24, seed=5, unknown=0.3, absent=0.2)
    dense = np.random.default_rng(5).random((24, 13), dtype=np.float32)
    decoder = InputDecoder(model.manifest, 4096)

    def request(a, b):
        return decoder.decode([Tensor("ids", "UINT64", ids[a:b].shape, ids[a:b].reshape(-1)),
                               Tensor("dense", "FP32", dense[a:b].shape, dense[a:b].reshape(-1))])

    async def go():
        batcher = Batcher(StaticSource(model), BatchingConfig(max_delay_ms=20))
        batcher.start()
        try:
            alone = [await batcher.infer(request(i, i + 1)) for i in range(4)]
            merged = await asyncio.gather(*(batcher.infer(request(i, i + 2)) for i in range(4, 24, 2)))
            return alone + list(merged)
        finally:
            await batcher.close()

    results = asyncio.run(go())
    assert max(r.micro_batch_rows for r in results) > 2  # some requests were merged
    np.testing.assert_allclose(np.concatenate([r.probability for r in results]), reference(tmp_path / "b", ids, dense),
                               rtol=0, atol=1e-5)


class _Scaled(torch.nn.Module):
    """Its output scale is a plain attribute: two instances with different scales look alike to the exporter's
    key (class, layers, weights), but answer differently."""

    def __init__(self, scale: float):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.scale = scale

    def forward(self, dense, embeddings):
        return (self.linear(dense) * self.scale).squeeze(-1)


def test_a_later_version_of_an_architecture_reuses_its_export_with_its_own_weights(tmp_path, capsys):
    """A follower's next version (same model, new weights) is not exported again: its weights go into the graph
    exported for the first, and it answers as its own eager model. A model that looks the same to the export's
    key but answers differently is caught by the check and exported afresh."""
    import dataclasses

    bundle = _bundle_of(tmp_path, "multitask_parquet.yaml")
    first = load_model(bundle, compile=True)
    later = load_model(bundle)
    with torch.no_grad():
        for p in later.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    bags = _probe_bags(first)
    again = CompiledDense.build(later.model, first.pooler.pool_host(bags), first.manifest.num_dense)
    assert again is not None and again.reweighted
    tensors = _named_request(first.manifest, 16, 3)
    want = _forward(later, tensors)
    got = _forward(dataclasses.replace(later, compiled=again), tensors)
    assert np.abs(got - _forward(first, tensors)).max() > 1e-3  # the new weights answer, not the first's
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    nothing = PooledEmbeddings()  # a model of the dense features alone: the flat signature is `dense`
    doubled = CompiledDense.build(_Scaled(2.0).eval(), nothing, 4)
    tripled_model = _Scaled(3.0).eval()
    tripled = CompiledDense.build(tripled_model, nothing, 4)
    assert doubled is not None and not doubled.reweighted
    assert tripled is not None and not tripled.reweighted  # the doubled graph failed its check: exported again
    logged = capsys.readouterr()
    assert "dense_forward_reexported" in logged.out + logged.err
    dense = torch.randn(5, 4)
    with torch.inference_mode():
        want = torch.sigmoid(tripled_model(dense, nothing)).numpy()
    np.testing.assert_allclose(tripled(dense.numpy(), nothing), want, rtol=0, atol=1e-5)
