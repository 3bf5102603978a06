"""The PS optimizers against torch.optim (and FTRL against TensorFlow's formula), several steps, within 1e-6."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridrec.core.config import EmbeddingOptimizer, EmbeddingOptimizerConfig, PSConfig, from_dict
from services.embedding_ps import optimizers as O
from services.embedding_ps.optimizers import OPTIMIZER_CODES, accumulator_width, hyper_parameters, state_width
from services.embedding_ps.store import EmbeddingStore, StoreConfig, init_rows

DIM, ROWS, STEPS = 6, 40, 6
KEYS = np.arange(1000, 1000 + ROWS, dtype=np.uint64)


def make_store(tmp_path, spec: EmbeddingOptimizerConfig, *, weight_bound=None
               ) -> tuple[EmbeddingStore, np.ndarray]:
    ps = PSConfig(capacity=4 * ROWS, num_stripes=4, init={"scale": 0.5}, weight_bound=weight_bound)
    store = EmbeddingStore.open(tmp_path / spec.name, StoreConfig(dim=DIM, optimizer=spec, ps=ps, seed=5))
    init = store.lookup(KEYS, train=True)
    np.testing.assert_array_equal(init, init_rows(KEYS, dim=DIM, seed=5, distribution="uniform", scale=0.5))
    return store, init


def grad_steps(seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((ROWS, DIM)) * 0.3).astype(np.float32) for _ in range(STEPS)]


def state_of(store: EmbeddingStore) -> np.ndarray:
    """The rows (weights + state) in KEYS order."""
    keys, values = store.items()
    return values[np.argsort(keys)][np.argsort(np.argsort(KEYS))]


def torch_optimizer(spec: EmbeddingOptimizerConfig, params):
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.name == "adagrad":
        return torch.optim.Adagrad(params, lr=spec.lr, eps=spec.eps, weight_decay=spec.weight_decay,
                                   initial_accumulator_value=spec.initial_accumulator_value)
    return torch.optim.Adam(params, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.adam_eps,
                            weight_decay=spec.weight_decay)


def torch_state(spec: EmbeddingOptimizerConfig, opt, param) -> np.ndarray:
    """torch's optimizer state laid out as the store's row state."""
    st = opt.state[param]
    if spec.name == "sgd":
        return np.zeros((param.shape[0], 0), np.float32)
    if spec.name == "adagrad":
        return st["sum"].numpy()
    step = np.full((param.shape[0], 1), float(st["step"]), np.float32)
    return np.hstack([st["exp_avg"].numpy(), st["exp_avg_sq"].numpy(), step])


SPECS = [
    EmbeddingOptimizerConfig(name="sgd", lr=0.1),
    EmbeddingOptimizerConfig(name="sgd", lr=0.05, weight_decay=0.01),
    EmbeddingOptimizerConfig(name="adagrad", lr=0.1),
    EmbeddingOptimizerConfig(name="adagrad", lr=0.3, initial_accumulator_value=0.1, weight_decay=0.02,
                             eps=1e-6),
    EmbeddingOptimizerConfig(name="adam", lr=0.01),
    EmbeddingOptimizerConfig(name="adam", lr=0.02, beta1=0.3, beta2=0.9, adam_eps=1e-6, weight_decay=0.05),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-lr{s.lr}-wd{s.weight_decay}")
def test_dense_steps_match_torch(tmp_path, spec):
    store, init = make_store(tmp_path, spec)
    param = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = torch_optimizer(spec, [param])
    try:
        for grads in grad_steps():
            assert store.update(KEYS, grads) == ROWS
            param.grad = torch.from_numpy(grads.copy())
            opt.step()
        rows = state_of(store)
        assert rows.shape == (ROWS, DIM + state_width(spec, DIM))
        np.testing.assert_allclose(rows[:, :DIM], param.detach().numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(rows[:, DIM:], torch_state(spec, opt, param), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(store.lookup(KEYS, train=False), rows[:, :DIM])
        assert np.abs(rows[:, :DIM] - init).max() > 1e-3  # the steps did move the weights
    finally:
        store.close()


@pytest.mark.parametrize("spec", [SPECS[3], SPECS[5]], ids=["adagrad", "adam"])
def test_sparse_steps_match_torch_per_row(tmp_path, spec):
    """Rows skipped in a step keep their state; Adam's per-row step counts only that row's updates."""
    store, init = make_store(tmp_path, spec)
    params = [torch.nn.Parameter(torch.from_numpy(init[r:r + 1].copy())) for r in range(ROWS)]
    opt = torch_optimizer(spec, params)
    rng = np.random.default_rng(1)
    try:
        for grads in grad_steps(2):
            rows = np.flatnonzero(rng.random(ROWS) < 0.5)
            assert store.update(KEYS[rows], grads[rows]) == len(rows)
            for r, p in enumerate(params):
                p.grad = torch.from_numpy(grads[r:r + 1].copy()) if r in rows else None
            opt.step()
        got = state_of(store)
        want = np.vstack([p.detach().numpy() for p in params])
        np.testing.assert_allclose(got[:, :DIM], want, rtol=0, atol=1e-6)
        for r, p in enumerate(params):
            if p in opt.state:
                np.testing.assert_allclose(got[r, DIM:], torch_state(spec, opt, p)[0], rtol=0, atol=1e-6)
    finally:
        store.close()


def test_weight_bound_matches_torch_with_clamp(tmp_path):
    spec = EmbeddingOptimizerConfig(name="adagrad", lr=0.5)
    store, init = make_store(tmp_path, spec, weight_bound=0.3)
    param = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = torch_optimizer(spec, [param])
    try:
        for grads in grad_steps(3):
            store.update(KEYS, grads)
            param.grad = torch.from_numpy(grads.copy())
            opt.step()
            with torch.no_grad():
                param.clamp_(-0.3, 0.3)
        rows = store.lookup(KEYS, train=False)
        np.testing.assert_allclose(rows, param.detach().numpy(), rtol=0, atol=1e-6)
        assert np.abs(rows).max() == pytest.approx(0.3)
    finally:
        store.close()


def ftrl_reference(w, accum, linear, g, *, lr, lr_power, l1, l2):
    """TensorFlow ApplyFtrl, float64 math, state kept in float32 between steps like the store."""
    w, accum, linear, g = (x.astype(np.float64) for x in (w, accum, linear, g))
    new_accum = accum + g * g
    linear = linear + g - (new_accum ** -lr_power - accum ** -lr_power) / lr * w
    quadratic = new_accum ** -lr_power / lr + 2 * l2
    w = np.where(np.abs(linear) > l1, (np.sign(linear) * l1 - linear) / quadratic, 0.0)
    return w.astype(np.float32), new_accum.astype(np.float32), linear.astype(np.float32)


def test_ftrl_matches_tensorflow_formula(tmp_path):
    spec = EmbeddingOptimizerConfig(name="ftrl", lr=0.1, initial_accumulator_value=0.1, l1=0.01, l2=0.001)
    store, init = make_store(tmp_path, spec)
    w, accum, linear = init, np.full_like(init, 0.1), np.zeros_like(init)
    try:
        np.testing.assert_array_equal(state_of(store)[:, DIM:], np.hstack([accum, linear]))
        for grads in grad_steps(4):
            store.update(KEYS, grads)
            w, accum, linear = ftrl_reference(w, accum, linear, grads, lr=0.1, lr_power=-0.5, l1=0.01, l2=0.001)
        rows = state_of(store)
        np.testing.assert_allclose(rows[:, :DIM], w, rtol=0, atol=1e-6)
        np.testing.assert_allclose(rows[:, DIM:2 * DIM], accum, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(rows[:, 2 * DIM:], linear, rtol=1e-6, atol=1e-6)
        assert (rows[:, :DIM] == 0).any() and (rows[:, :DIM] != 0).any()  # l1 zeroes some weights
    finally:
        store.close()


def test_state_widths_and_spec_validation():
    assert [state_width(EmbeddingOptimizerConfig(name=n), 16) for n in ("sgd", "adagrad", "adam", "ftrl")] \
        == [0, 16, 33, 32]
    for kw, field in [(dict(name="rmsprop"), "name"), (dict(name="sgd", lr=0), "lr"),
                      (dict(name="adam", beta1=1.0), "beta1"), (dict(name="adagrad", eps=-1), "eps"),
                      (dict(name="ftrl", lr_power=0.5), "lr_power")]:
        with pytest.raises(ValueError, match=field):
            EmbeddingOptimizerConfig(**kw)
    spec = EmbeddingOptimizerConfig(name="adam", lr=0.5)
    assert EmbeddingOptimizerConfig.model_validate(json.loads(json.dumps(spec.model_dump(mode="json")))) == spec


def test_every_optimizer_has_a_kernel_code_and_state():
    """The enum in hybridrec/core/config/optimizers.py is the one list of names: the PS must handle each of its
    members."""
    assert set(OPTIMIZER_CODES) == set(EmbeddingOptimizer)
    assert len(set(OPTIMIZER_CODES.values())) == len(OPTIMIZER_CODES)
    for name in EmbeddingOptimizer:
        spec = EmbeddingOptimizerConfig(name=name)
        assert state_width(spec, 8) >= accumulator_width(spec, 8) >= 0


def test_ftrl_settings_reach_the_kernel_from_the_config():
    config = from_dict({"data": {"train": ["a.tsv"]}, "optimizer": {"embedding": {
        "name": "ftrl", "lr": 0.2, "l1": 0.25, "l2": 0.125, "lr_power": -0.75}}})
    store = StoreConfig.from_config(config, 16)
    assert store.optimizer is config.optimizer.embedding and store.ps is config.ps
    hp = hyper_parameters(store.optimizer, store.ps.weight_bound)
    assert (hp[O.HP_LR], hp[O.HP_L1], hp[O.HP_L2], hp[O.HP_LR_POWER]) == (0.2, 0.25, 0.125, -0.75)
    assert np.isnan(hp[O.HP_BOUND])
