"""The NN workers' guard against steps that are not finite (services/nn_worker/step.py, `training.on_nonfinite`):
a step whose loss or gradients are NaN or infinite updates nothing (the dense model and its optimizer's state
stay as they were), says so, and the next step trains as if it had not happened; on two ranks where only one
rank's embedding gradients are not finite, both skip the step alike and the replicas stay equal.

The whole path through the services (a model that makes a NaN on a chosen step, PS rows, checkpoints) is
tests/integration/test_nonfinite.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.core.config import from_dict
from services.nn_worker.group.distributed import DenseSync
from services.nn_worker.step import make_dense_optimizer
from tests.unit.nonfinite_ranks import WORLD, rank_main
from tests.unit.spawned import run_ranks
from tests.unit.test_step_math import _setup


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_step_that_is_not_finite_updates_nothing(group_of_one, optimizer, bad):  # noqa: F811
    math, model, batch, emb = _setup()
    math.sync = DenseSync(model, math.env, math.training)
    config = from_dict({"data": {"train": ["x"]}, "optimizer": {"dense": {"name": optimizer, "weight_decay": 0.01}}})
    math.optimizer = make_dense_optimizer(model, config)
    assert not math.train(batch, emb, step=1).nonfinite  # the optimizer has state now (Adam: step 1)
    params = [p.detach().clone() for p in model.parameters()]
    state = {(id(p), k): v.clone() for p, s in math.optimizer.state.items() for k, v in s.items()}
    poisoned = batch.__class__(batch.batch_ref, batch.dense.copy(), batch.labels)
    poisoned.dense[2, 1] = bad
    step = math.train(poisoned, emb, step=2)
    assert step.nonfinite and not np.isfinite(step.loss())
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert len(state) == sum(len(s) for s in math.optimizer.state.values())
    assert all(torch.equal(state[(id(p), k)], v) for p, s in math.optimizer.state.items() for k, v in s.items())
    step = math.train(batch, emb, step=3)  # the next step trains
    assert not step.nonfinite and any(not torch.equal(a, b) for a, b in zip(params, model.parameters()))
    if optimizer == "adam":
        assert all(float(s["step"]) == 2 for s in math.optimizer.state.values())  # the skipped step not counted


def test_a_step_not_finite_on_one_rank_is_skipped_by_every_rank(tmp_path):
    run_ranks(rank_main, WORLD, tmp_path, timeout_s=180)
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(WORLD)]
    for r in ranks:
        assert not r["first_nonfinite"] and r["second_nonfinite"] and not r["third_nonfinite"]
        assert r["state_unchanged"]
        np.testing.assert_array_equal(r["after_first"], r["after_second"])  # nothing updated on either rank
        assert not np.array_equal(r["after_second"], r["after_third"])
    assert np.isfinite(ranks[0]["second_loss"]) and np.isfinite(ranks[1]["second_loss"])  # only rank 1's gradients
    np.testing.assert_array_equal(ranks[0]["after_third"], ranks[1]["after_third"])  # the replicas stay equal
