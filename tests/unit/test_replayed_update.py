"""A replacement NN worker re-derives an owed embedding update (Trainer._embedding_gradients): the gradients are
the batch's loss gradients with respect to its embedding rows, and the dense model is left untouched."""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from hybridrec.config import from_dict
from hybridrec.frames import DenseBatch, Embeddings
from hybridrec.jagged import KeyedBags
from hybridrec.models import FeatureInfo, build_model
from services.nn_worker.distributed import DistEnv
from services.nn_worker.compute import ComputeThread
from services.nn_worker.trainer import Trainer

BATCH = 6


def _setup():
    config = from_dict({"data": {"train": ["x"]}, "num_dense": 3,
                        "features": [{"name": "a", "group": 0, "dim": 4}, {"name": "b", "group": 1, "dim": 4}],
                        "training": {"compression": {"fp16": False}}})
    torch.manual_seed(0)
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features], config.num_dense,
                        config.model.kwargs)
    env = DistEnv(rank=0, world_size=1, backend="gloo", device=torch.device("cpu"))
    trainer = Trainer(config, env, model, None, None, asyncio.Queue(), ComputeThread())
    rng = np.random.default_rng(0)
    counts = np.array([3, 2], np.int32)
    pos = np.concatenate([rng.integers(0, c, BATCH) for c in counts]).astype(np.uint16)
    frame = Embeddings(KeyedBags(pos, np.ones((2, BATCH), np.uint16)), counts,
                       {4: rng.standard_normal((5, 4)).astype(np.float32)}).encode(trainer.values)
    batch = DenseBatch(1, rng.standard_normal((BATCH, 3)).astype(np.float32),
                       rng.integers(0, 2, BATCH).astype(np.float32))
    return trainer, model, batch, trainer.pooler.decode(frame, BATCH)


def test_owed_update_is_the_loss_gradient_of_the_embedding_rows_and_leaves_the_dense_model_alone():
    trainer, model, batch, emb = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    grads = trainer._embedding_gradients(batch, emb)

    leaves, embeddings = trainer.pooler.pool(emb, torch.device("cpu"), grad=True)  # the plain computation
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        model(torch.from_numpy(batch.dense), embeddings).reshape(-1), torch.from_numpy(batch.labels))
    expected = torch.autograd.grad(loss, [leaves[4]])[0].numpy()
    assert set(grads) == {4} and grads[4].shape == (5, 4) and np.abs(grads[4]).sum() > 0
    np.testing.assert_allclose(grads[4], expected, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
