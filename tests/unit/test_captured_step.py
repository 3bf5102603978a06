"""The captured step's padding (services/nn_worker/captured.py), on the CPU: the padded step without a graph
(`CapturedStep(math, graphs=False)`) against the eager step (`StepMath.train`), from the same model, on the
same batches, in a real Gloo group of one.

* Twenty steps of batches of varying shapes (multi-hot mean and sqrt-n bags, a width whose features are not
  neighbours in config order, missing IDs, fp16 rows and fp32 rows, a falling learning rate): every step's loss,
  logits and embedding gradients, and the dense parameters after them, equal the eager step's within 1e-5; the
  gradients have the batch's real rows, no padding row.
* A batch larger than every bucket so far gets a larger bucket, and all of its rows' gradients.
* A step whose rows hold a NaN is not finite and changes nothing, padded or not.
* Where capture is refused (several ranks, a sequence feature, a falling rate with an optimizer that holds it
  as a number), `train` says why and returns None: the caller steps eagerly.
"""
from __future__ import annotations

import copy
import numpy as np
import pytest
import torch

from hybridrec.core.config import from_dict
from hybridrec.core.model.models import FeatureInfo, build_model
from hybridrec.core.model.pooling import Pooler
from hybridrec.core.model.tasks import Tasks
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.wire.frames import DenseBatch, Embeddings
from hybridrec.core.wire.jagged import KeyedBags
from services.nn_worker.captured import LADDER_STEP, CapturedStep, Layout, bucket
from services.nn_worker.group.distributed import DenseSync, DistEnv
from services.nn_worker.lr_decay import LrDecay
from services.nn_worker.step import StepMath, make_dense_optimizer

FEATURES = [  # width 4: a, c, d (c not next to a); width 8: b
    {"name": "a", "group": 0, "dim": 4, "kind": "list", "pooling": "mean", "max_len": 3},
    {"name": "b", "group": 1, "dim": 8},
    {"name": "c", "group": 2, "dim": 4, "kind": "list", "pooling": "sqrtn", "max_len": 4},
    {"name": "d", "group": 3, "dim": 4},
]


def _config(fp16: bool, features=FEATURES, dense: str = "adam"):
    return from_dict({"data": {"train": ["x"], "format": "parquet"}, "num_dense": 3, "features": features,
                      "model": {"kwargs": {"hidden": [16, 8]}},
                      "training": {"compression": {"fp16": fp16}}, "optimizer": {"dense": {"name": dense}}})


def _math(config, model, world_size: int = 1) -> StepMath:
    env = DistEnv(rank=0, world_size=world_size, backend="gloo", device=torch.device("cpu"))
    values = ValueCodec(fp16=config.training.compression.fp16)
    math = StepMath(model, env, config.training, Tasks.from_config(config), Pooler(config.features, values))
    math.optimizer = make_dense_optimizer(model, config)
    math.decay = LrDecay(base=0.01, start=10, total=20, floor=0.1)
    return math


def _pair(config):
    torch.manual_seed(0)
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features], config.num_dense,
                        config.model.kwargs)
    eager, padded = _math(config, model), _math(config, copy.deepcopy(model))
    for math in (eager, padded):
        math.sync = DenseSync(math.model, math.env, math.training)
    padded.captured = CapturedStep(padded, graphs=False)
    return eager, padded


def _batch(rng: np.random.Generator, config, size: int, *, nan: bool = False) -> tuple[DenseBatch, bytes]:
    """A batch of `size` samples: each list feature's bags 0..max_len long, scalar features missing at times, a
    random number of unique rows per feature (every one used)."""
    lengths, pos, counts = [], [], []
    for f in config.features:
        top = f.max_len if f.kind == "list" else 1
        n = rng.integers(0, top + 1, size)
        unique = int(min(n.sum(), rng.integers(1, 2 * size)))
        values = rng.integers(0, max(unique, 1), int(n.sum()))
        values[:unique] = np.arange(unique)  # every row read at least once
        lengths.append(n)
        pos.append(values)
        counts.append(unique)
    counts = np.array(counts, np.int32)
    rows = {}
    for dim in sorted({f.dim for f in config.features}):
        total = sum(int(c) for c, f in zip(counts, config.features) if f.dim == dim)
        rows[dim] = rng.standard_normal((total, dim)).astype(np.float32)
    if nan:
        rows[4][0, 0] = np.nan
    values = ValueCodec(fp16=config.training.compression.fp16)
    frame = Embeddings(KeyedBags(np.concatenate(pos).astype(np.uint16), np.stack(lengths).astype(np.uint16)),
                       counts, rows).encode(values)
    batch = DenseBatch(1, rng.standard_normal((size, 3)).astype(np.float32),
                       rng.integers(0, 2, size).astype(np.float32))
    return batch, frame


def _step(math: StepMath, batch: DenseBatch, frame: bytes, number: int):
    return math.train(batch, math.pooler.decode(frame, batch.labels.shape[0]), step=number)


def test_the_ladder_holds_every_count_and_grows():
    sizes = [bucket(n) for n in range(1, 20_000, 37)]
    assert all(s >= n and s % LADDER_STEP == 0 for s, n in zip(sizes, range(1, 20_000, 37)))
    ladder = sorted(set(sizes))
    assert ladder[0] == LADDER_STEP and all(b >= 1.25 * a for a, b in zip(ladder, ladder[1:]))


def test_a_layouts_arrays_are_aligned_and_apart():
    layout = Layout([("a", np.float16, (5, 3)), ("b", np.int64, (7,)), ("c", np.uint16, (2, 9))])
    spans = sorted((offset, offset + int(np.prod(shape)) * dtype.itemsize)
                   for offset, dtype, shape in layout.fields.values())
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= after for (_, end), (after, _) in zip(spans, spans[1:])) and spans[-1][1] <= layout.size
    host = layout.host_views(np.zeros(layout.size, np.uint8))
    device = layout.device_views(torch.zeros(layout.size, dtype=torch.uint8))
    host["b"][:] = np.arange(7)
    assert torch.equal(device["b"], torch.zeros(7, dtype=torch.int64))  # two buffers
    assert {k: v.shape for k, v in host.items()} == {k: tuple(v.shape) for k, v in device.items()}


@pytest.mark.parametrize("fp16", [True, False])
def test_padded_steps_train_as_the_eager_steps(group_of_one, fp16):
    config = _config(fp16)
    eager, padded = _pair(config)
    rng = np.random.default_rng(1)
    for number in range(1, 21):
        batch, frame = _batch(rng, config, int(rng.integers(20, 90)))
        want, got = _step(eager, batch, frame, number), _step(padded, batch, frame, number)
        assert got.grad_keys == want.grad_keys and not got.nonfinite
        np.testing.assert_allclose(got.loss(), want.loss(), rtol=1e-5)
        np.testing.assert_allclose(got.host["logits"].numpy(), want.host["logits"].numpy(), rtol=1e-5, atol=1e-5)
        for key, value in want.packed().items():
            assert got.packed()[key].shape == value.shape, key  # the real rows: no padding row, none cut
            np.testing.assert_allclose(got.packed()[key].astype(np.float32), value.astype(np.float32),
                                       rtol=1e-3 if fp16 else 1e-5, atol=1e-3 if fp16 else 1e-6, err_msg=key)
    assert padded.optimizer.param_groups[0]["lr"] == pytest.approx(eager.optimizer.param_groups[0]["lr"])
    for a, b in zip(eager.model.parameters(), padded.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert 1 <= len(padded.captured.buckets) < 20  # the shapes share buckets


def test_a_batch_larger_than_every_bucket_gets_a_larger_one(group_of_one):
    config = _config(False)
    eager, padded = _pair(config)
    rng = np.random.default_rng(2)
    small, small_frame = _batch(rng, config, 16)
    _step(eager, small, small_frame, 1), _step(padded, small, small_frame, 1)
    first = set(padded.captured.buckets)
    large, large_frame = _batch(rng, config, 900)
    want, got = _step(eager, large, large_frame, 2), _step(padded, large, large_frame, 2)
    (new,) = set(padded.captured.buckets) - first
    assert all(r > o for r, o in zip(new.rows, next(iter(first)).rows))
    for key, value in want.packed().items():
        assert got.packed()[key].shape == value.shape
        np.testing.assert_allclose(got.packed()[key], value, rtol=1e-5, atol=1e-6)


def test_a_step_that_is_not_finite_changes_nothing_padded(group_of_one):
    config = _config(False)
    _, padded = _pair(config)
    rng = np.random.default_rng(3)
    batch, frame = _batch(rng, config, 32, nan=True)
    before = [p.detach().clone() for p in padded.model.parameters()]
    step = _step(padded, batch, frame, 1)
    assert step.nonfinite and padded.captured.buckets
    assert all(torch.equal(a, b) for a, b in zip(before, padded.model.parameters()))


@pytest.mark.parametrize("case", ["ranks", "sequence", "sgd-decay"])
def test_where_capture_is_refused_it_says_why_and_steps_eagerly(case):
    features = FEATURES + [{"name": "s", "group": 4, "dim": 4, "kind": "list", "pooling": "none"}] \
        if case == "sequence" else FEATURES
    config = _config(False, features, dense="sgd" if case == "sgd-decay" else "adam")
    torch.manual_seed(0)
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features], config.num_dense,
                        config.model.kwargs)
    math = _math(config, model, world_size=2 if case == "ranks" else 1)
    captured = CapturedStep(math, graphs=False)
    batch, frame = _batch(np.random.default_rng(4), config, 8) if case != "sequence" else (None, None)
    why = {"ranks": "several NN workers", "sequence": "sequence feature", "sgd-decay": "only Adam"}[case]
    assert why in captured.refusal()
    if batch is not None:
        assert captured.train(batch, math.pooler.decode(frame, 8), 1) is None and not captured.buckets
