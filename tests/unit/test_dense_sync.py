"""DenseSync with real torch.distributed (Gloo, 2 processes on loopback).

One pair of processes (spawned once per module; most of their time goes to
importing torch, and torch._dynamo, which DDP pulls in) runs every scenario in
turn on one process group and writes each replica's parameters at every point
of interest to an .npz file; the tests compare the two ranks' files. Each
rank initialises its model from a different seed and trains on different data,
so replicas only agree where DenseSync made them agree.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.unit.dense_sync_ranks import LR, STEPS, SYNC_INTERVAL, WORLD, rank_main
from tests.unit.spawned import run_ranks

TIMEOUT_S = 90  # a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, np.ndarray]]:
    out = tmp_path_factory.mktemp("dense_sync")
    run_ranks(rank_main, WORLD, out, TIMEOUT_S)
    loaded = []
    for rank in range(WORLD):
        with np.load(out / f"rank{rank}.npz") as data:
            loaded.append({k: data[k] for k in data.files})
    return loaded


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
def test_replicas_start_from_rank_0s_weights(results, mode):
    r0, r1 = results
    assert not _same(r0[f"{mode}/init"], r1[f"{mode}/init"]), "the ranks should initialise differently"
    np.testing.assert_array_equal(r0[f"{mode}/start"], r0[f"{mode}/init"])
    np.testing.assert_array_equal(r1[f"{mode}/start"], r0[f"{mode}/init"])  # rank 1 got rank 0's weights


@pytest.mark.parametrize("mode", ["hybrid", "sync"])
def test_ddp_keeps_replicas_identical(results, mode):
    r0, r1 = results
    assert not _same(r0[f"{mode}/local_grad1"], r1[f"{mode}/local_grad1"]), "the ranks' data should differ"
    for step in range(1, STEPS + 1):
        np.testing.assert_allclose(r1[f"{mode}/step{step}"], r0[f"{mode}/step{step}"], rtol=0, atol=1e-6,
                                   err_msg=f"step {step}")
    # Step 1 applied the average of the two ranks' gradients.
    mean_grad = (r0[f"{mode}/local_grad1"] + r1[f"{mode}/local_grad1"]) / 2
    np.testing.assert_allclose(r0[f"{mode}/step1"], r0[f"{mode}/start"] - LR * mean_grad, rtol=0, atol=1e-6)
    assert not _same(r0[f"{mode}/step{STEPS}"], r0[f"{mode}/start"])  # training moved the weights
    np.testing.assert_allclose(r1[f"{mode}/finish"], r0[f"{mode}/finish"], rtol=0, atol=1e-6)


def test_async_replicas_diverge_between_averaging_points(results):
    r0, r1 = results
    # Step 1 applied each rank's own gradient: no AllReduce in async mode.
    for r in (r0, r1):
        np.testing.assert_allclose(r["async/step1"], r["async/start"] - LR * r["async/local_grad1"], rtol=0,
                                   atol=1e-6)
    for step in range(1, STEPS + 1):
        a, b = r0[f"async/step{step}"], r1[f"async/step{step}"]
        if step % SYNC_INTERVAL == 0:
            assert _same(a, b), f"replicas should be averaged after step {step}"
            # ... to the mean of what each had just before
            np.testing.assert_allclose(a, (r0[f"async/pre{step}"] + r1[f"async/pre{step}"]) / 2, rtol=0, atol=1e-6)
            assert not _same(r0[f"async/pre{step}"], r1[f"async/pre{step}"])
        else:
            assert not _same(a, b), f"replicas should differ after step {step}"
            np.testing.assert_array_equal(a, r0[f"async/pre{step}"])  # after_step left them alone


def test_async_finish_averages(results):
    r0, r1 = results
    assert STEPS % SYNC_INTERVAL != 0 and not _same(r0[f"async/step{STEPS}"], r1[f"async/step{STEPS}"])
    np.testing.assert_allclose(r0["async/finish"], r1["async/finish"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(r0["async/finish"], (r0[f"async/step{STEPS}"] + r1[f"async/step{STEPS}"]) / 2,
                               rtol=0, atol=1e-6)
