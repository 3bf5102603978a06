"""The NN worker's step math (services/nn_worker/step.py), run as plain calls: no trainer, no event loop, a
real Gloo group of one.

* A replacement re-derives an owed embedding update (`StepMath.embedding_gradients`): the gradients are the
  batch's loss gradients with respect to its embedding rows, and the dense model is left untouched.
* A training step is forward, loss, backward and the optimizer, and its packed gradients are the embedding
  rows' loss gradients; a lost batch's step (weight 0) changes nothing but still runs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import from_dict
from hybridrec.core.wire.frames import DenseBatch, Embeddings
from hybridrec.core.wire.jagged import KeyedBags
from hybridrec.core.model.models import FeatureInfo, build_model
from hybridrec.core.model.pooling import Pooler
from hybridrec.core.model.tasks import Tasks
from services.nn_worker.group.distributed import DenseSync, DistEnv
from services.nn_worker.lr_decay import LrDecay
from services.nn_worker.step import StepMath, make_dense_optimizer

BATCH = 6


def _setup():
    config = from_dict({"data": {"train": ["x"]}, "num_dense": 3,
                        "features": [{"name": "a", "group": 0, "dim": 4}, {"name": "b", "group": 1, "dim": 4}],
                        "training": {"compression": {"fp16": False}}, "optimizer": {"dense": {"name": "sgd"}}})
    torch.manual_seed(0)
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features], config.num_dense,
                        config.model.kwargs)
    env = DistEnv(rank=0, world_size=1, backend="gloo", device=torch.device("cpu"))
    values = ValueCodec(fp16=False)
    math = StepMath(model, env, config.training, Tasks.from_config(config), Pooler(config.features, values))
    math.optimizer = make_dense_optimizer(model, config)
    rng = np.random.default_rng(0)
    counts = np.array([3, 2], np.int32)
    pos = np.concatenate([rng.integers(0, c, BATCH) for c in counts]).astype(np.uint16)
    frame = Embeddings(KeyedBags(pos, np.ones((2, BATCH), np.uint16)), counts,
                       {4: rng.standard_normal((5, 4)).astype(np.float32)}).encode(values)
    batch = DenseBatch(1, rng.standard_normal((BATCH, 3)).astype(np.float32),
                       rng.integers(0, 2, BATCH).astype(np.float32))
    return math, model, batch, math.pooler.decode(frame, BATCH)


def _expected_gradients(math: StepMath, model, batch, emb) -> np.ndarray:
    """The plain computation: the batch's log loss differentiated by its embedding rows."""
    leaves, embeddings = math.pooler.pool(emb, torch.device("cpu"), grad=True)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        model(torch.from_numpy(batch.dense), embeddings).reshape(-1), torch.from_numpy(batch.labels))
    return torch.autograd.grad(loss, [leaves[4]])[0].numpy()


def test_owed_update_is_the_loss_gradient_of_the_embedding_rows_and_leaves_the_dense_model_alone():
    math, model, batch, emb = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    grads = math.embedding_gradients(batch, emb)
    expected = _expected_gradients(math, model, batch, emb)
    assert set(grads) == {4} and grads[4].shape == (5, 4) and np.abs(grads[4]).sum() > 0
    np.testing.assert_allclose(grads[4], expected, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_step_trains_the_dense_model_and_packs_the_embedding_gradients(group_of_one):
    math, model, batch, emb = _setup()
    math.sync = DenseSync(model, math.env, math.training)
    expected = _expected_gradients(math, model, batch, emb)
    before = [p.detach().clone() for p in model.parameters()]
    step = math.train(batch, emb, step=1)
    assert step.event is None and step.written is None
    assert np.isfinite(step.loss()) and step.loss() > 0
    assert step.host["logits"].shape == (BATCH,)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    packed = step.packed()
    assert set(packed) == set(step.grad_keys) and len(packed) == 1  # fp32: the width's rows' gradients as they are
    np.testing.assert_allclose(next(iter(packed.values())), expected, rtol=1e-5, atol=1e-7)


def test_a_lost_batchs_step_runs_with_weight_zero(group_of_one):
    math, model, batch, emb = _setup()
    math.sync = DenseSync(model, math.env, math.training)
    before = [p.detach().clone() for p in model.parameters()]
    step = math.train(batch, emb, step=7, lost=True)
    assert step.loss() == 0.0 and not any(g.any() for g in step.packed().values())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # SGD without weight decay


def test_the_learning_rate_falls_as_the_decay_says(group_of_one):
    """`optimizer.dense.decay`: each step's rate is `LrDecay.lr(step)`, down to none at the last step."""
    math, model, batch, emb = _setup()
    math.sync = DenseSync(model, math.env, math.training)
    math.decay = LrDecay(base=0.1, start=6, total=10, floor=0.0)
    math.train(batch, emb, step=8)
    assert math.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    before = [p.detach().clone() for p in model.parameters()]
    math.train(batch, emb, step=10)  # SGD at rate 0: the step changes nothing
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    math.decay = LrDecay(base=0.2, start=10**9, total=10**9, floor=1.0)  # resumed without the fall
    math.train(batch, emb, step=11)  # the optimizer's state said 0 (where the fall ended): the config's rate wins
    assert math.optimizer.param_groups[0]["lr"] == 0.2
