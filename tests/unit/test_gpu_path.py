"""The NN worker's GPU path, tested on a CPU-only machine: what NCCL would refuse or break, reproduced here.

* The control collectives run in a group whose default backend serves no CPU tensors (`cuda:gloo`, as NCCL):
  two real ranks (tests/unit/control_group_ranks.py).
* Backend and device resolution, with the host's CUDA facts stubbed: `auto` on both branches, NCCL without
  CUDA, more ranks on a host than GPUs.
* A checkpoint whose tensors were saved on a CUDA device (the storage location tag is written without a GPU)
  loads on a CPU worker; another model's checkpoint is refused naming the file.

Tests marked `cuda` need a GPU and run wherever torch sees one (they are reported as skipped elsewhere).
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing

import numpy as np
import pytest
import torch

from hybridrec.core.config import ConfigError
from hybridrec.app.run.ports import free_port
from services.nn_worker.checkpoint import load_dense, on_cpu
from services.nn_worker.group.distributed import NCCL_ENVIRONMENT, resolve_backend
from tests.unit.control_group_ranks import WORLD, rank_main
from tests.unit.spawned import run_ranks

TIMEOUT_S = 120
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def control_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("control")
    run_ranks(rank_main, WORLD, out, TIMEOUT_S)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_the_default_group_refuses_cpu_tensors_like_nccl(control_results):
    for result in control_results:
        assert result["default_group_took_cpu"] is False
        assert "No backend type associated with device type cpu" in result["default_group_error"]


def test_checkpoint_vote_and_position_go_through_the_control_group(control_results):
    for result in control_results:
        assert result["time_up"] is True  # rank 1's interval was up
        assert result["position"] == [41, [0, 1, 7, 8], 3000]  # the newest rank's position; samples summed
        assert result["postponed"] == [None, False]  # rank 1 had not counted its predecessor's share: not written


def test_dense_sync_broadcasts_and_averages_cpu_parameters_through_the_control_group(control_results):
    r0, r1 = control_results
    assert r0["broadcast"] == r1["broadcast"]
    np.testing.assert_allclose(r0["averaged"], np.asarray(r0["broadcast"]) + 0.5, atol=1e-6)
    assert r0["averaged"] == r1["averaged"]


def test_hand_over_goes_through_the_control_group(control_results):
    r0, r1 = control_results
    assert r0["handed"] == r1["handed"]
    stats, wall, moments = r1["handed"]
    assert stats == {"steps": 10.0} and wall == 3.5 and any(m != 0 for m in moments)


def test_evaluation_and_statistics_go_through_the_control_group(control_results):
    for result in control_results:
        assert result["eval"] == [[0.25, 0.5, 0.5], [1.0, 1.0, 1.0]]
        totals = result["totals"]
        assert totals["samples"] == 3000 and totals["steps"] == 10 and totals["staleness_hist"] == [6, 2]
        assert totals["mean_train_loss"] == pytest.approx(0.5)


# -- backend and device -------------------------------------------------------------------------------------
@pytest.fixture
def nccl_env(monkeypatch):
    """resolve_backend sets NCCL's error-handling variables for the process: restored after each test."""
    for key in (*NCCL_ENVIRONMENT, "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_auto_is_gloo_on_the_cpu_without_cuda(nccl_env):
    env = resolve_backend("auto", 1, 2, cuda_available=False)
    assert (env.backend, env.device) == ("gloo", torch.device("cpu"))


def test_auto_is_nccl_on_the_local_ranks_gpu_with_cuda(nccl_env):
    env = resolve_backend("auto", 1, 2, cuda_available=True, device_count=2)
    assert (env.backend, env.device) == ("nccl", torch.device("cuda", 1))
    import os

    assert {k: os.environ[k] for k in NCCL_ENVIRONMENT} == NCCL_ENVIRONMENT  # errors raise, no watchdog kill


def test_the_local_rank_comes_from_LOCAL_RANK(nccl_env):
    nccl_env.setenv("LOCAL_RANK", "0")  # one container per rank, one GPU visible in each
    env = resolve_backend("nccl", 3, 4, cuda_available=True, device_count=1)
    assert env.device == torch.device("cuda", 0)


def test_nccl_without_cuda_is_refused_naming_the_setting(nccl_env):
    with pytest.raises(ConfigError, match="training.backend is nccl but CUDA is not available"):
        resolve_backend("nccl", 0, 2, cuda_available=False)


def test_two_ranks_on_one_gpu_are_refused_at_start(nccl_env):
    assert resolve_backend("nccl", 0, 2, cuda_available=True, device_count=1).device == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"rank 1 is local rank 1 on this host, which has 1 GPU"):
        resolve_backend("nccl", 1, 2, cuda_available=True, device_count=1)


# -- checkpoints ----------------------------------------------------------------------------------------------
CUDA_TAG_PRIORITY = -1000


@contextlib.contextmanager
def saved_as_cuda():
    """torch.save tags every storage 'cuda:0', as a GPU worker's state_dict would be (no GPU needed to write)."""
    import torch.serialization as serialization

    serialization.register_package(CUDA_TAG_PRIORITY, lambda obj: "cuda:0" if obj.device.type == "cpu" else None,
                                   lambda obj, location: None)
    try:
        yield
    finally:
        serialization._package_registry[:] = [e for e in serialization._package_registry
                                              if e[0] != CUDA_TAG_PRIORITY]


def _model_and_adam(seed: int, hidden: int = 8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_checkpoint_saved_on_cuda_resumes_on_a_cpu_worker(tmp_path):
    model, optimizer = _model_and_adam(seed=0)
    with saved_as_cuda():
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "dense.pt")
    # The premise: the file's tensors are tagged for a GPU (a plain load puts them there, or fails without one).
    if torch.cuda.is_available():
        tagged = torch.load(tmp_path / "dense.pt", weights_only=True)["model"]
        assert {t.device.type for t in tagged.values()} == {"cuda"}
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "dense.pt", weights_only=True)
    fresh, fresh_optimizer = _model_and_adam(seed=1)
    load_dense(tmp_path / "dense.pt", fresh, fresh_optimizer)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b)
    moments = fresh_optimizer.state_dict()["state"][0]["exp_avg"]
    torch.testing.assert_close(moments, optimizer.state_dict()["state"][0]["exp_avg"])
    assert moments.device.type == "cpu"


def test_another_models_checkpoint_is_refused_naming_the_file(tmp_path):
    model, optimizer = _model_and_adam(seed=0, hidden=8)
    torch.save(on_cpu({"model": model.state_dict(), "optimizer": optimizer.state_dict()}), tmp_path / "dense.pt")
    other, other_optimizer = _model_and_adam(seed=0, hidden=16)
    with pytest.raises(ConfigError, match=r"dense\.pt does not fit this job's dense model"):
        load_dense(tmp_path / "dense.pt", other, other_optimizer)


def test_on_cpu_copies_every_tensor_of_a_state_dict():
    model, optimizer = _model_and_adam(seed=0)
    state = on_cpu({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert state["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert all(t.device.type == "cpu" for t in state["model"].values())


# -- on a GPU -------------------------------------------------------------------------------------------------
@cuda
def test_cuda_checkpoint_loads_back_onto_the_gpu_and_onto_the_cpu(tmp_path):
    device = torch.device("cuda", 0)
    model, optimizer = _model_and_adam(seed=0)
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4, device=device)).sum().backward()
    optimizer.step()
    torch.save(on_cpu({"model": model.state_dict(), "optimizer": optimizer.state_dict()}), tmp_path / "dense.pt")
    on_gpu, gpu_optimizer = _model_and_adam(seed=1)
    on_gpu.to(device)
    gpu_optimizer = torch.optim.Adam(on_gpu.parameters(), lr=0.01)
    load_dense(tmp_path / "dense.pt", on_gpu, gpu_optimizer)
    assert gpu_optimizer.state_dict()["state"][0]["exp_avg"].device == device
    cpu_model, cpu_optimizer = _model_and_adam(seed=2)
    load_dense(tmp_path / "dense.pt", cpu_model, cpu_optimizer)
    torch.testing.assert_close(cpu_model[0].weight, model[0].weight.cpu())


# -- the feed: fp16 rows scaled back where they are pooled ----------------------------------------------------
def _fp16_batch(seed: int = 0):
    from hybridrec.core.wire.compress import ValueCodec
    from hybridrec.core.config import Pooling
    from hybridrec.core.wire.frames import Embeddings
    from tests.unit.test_pooling import _features, _frame

    widths = [4, 4, 3, 3]
    features = _features([Pooling.SUM, Pooling.MEAN, Pooling.SQRTN, Pooling.MEAN], widths)
    raw32, _, _ = _frame(widths, [5, 2, 7, 3], 9, seed=seed)
    values = ValueCodec(fp16=True)
    frame = Embeddings.decode(raw32, ValueCodec(fp16=False), widths, 9, ids_per_sample=4 * len(widths))
    return features, values, frame.encode(values, lz4=True)


def test_fp16_rows_kept_for_the_device_pool_as_rows_scaled_back_on_the_host():
    from hybridrec.core.wire.compress import Fp16Rows
    from hybridrec.core.model.pooling import Pooler
    from services.nn_worker.feed import DeviceFeed

    features, values, raw = _fp16_batch()
    host = Pooler(features, values).decode(raw, 9)
    kept = Pooler(features, values, keep_fp16=True).decode(raw, 9)
    assert all(isinstance(rows, Fp16Rows) for rows in kept.rows.values())
    dense = np.ones((9, 2), np.float32)
    staged_dense, _, staged = DeviceFeed(torch.device("cpu")).stage(dense, np.zeros(9, np.float32), kept)
    assert staged_dense.data_ptr() == torch.from_numpy(dense).data_ptr()  # on the CPU: no copy
    _, expected = Pooler(features, values).pool(host, torch.device("cpu"), grad=False)
    _, got = Pooler(features, values).pool(staged, torch.device("cpu"), grad=False)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


@cuda
@pytest.mark.parametrize("overlap", [True, False])
def test_the_feed_stages_a_batch_on_the_gpu_and_pools_it_as_the_cpu_does(overlap):
    from hybridrec.core.model.pooling import Pooler
    from services.nn_worker.feed import DeviceFeed

    device = torch.device("cuda", 0)
    features, values, raw = _fp16_batch(seed=1)
    feed = DeviceFeed(device, overlap=overlap)
    kept = Pooler(features, values, keep_fp16=True).decode(raw, 9)
    dense, labels, staged = feed.stage(np.ones((9, 2), np.float32), np.zeros(9, np.float32), kept)
    assert dense.device == device and all(rows.half.device == device for rows in staged.rows.values())
    leaves, got = Pooler(features, values).pool(staged, device, grad=True)
    _, expected = Pooler(features, values).pool(Pooler(features, values).decode(raw, 9), torch.device("cpu"),
                                                grad=False)
    for name in expected:
        torch.testing.assert_close(got[name].cpu(), expected[name], rtol=1e-5, atol=1e-5)
    sum(p.sum() for p in got.values()).backward()
    host, event = feed.to_host({d: leaf.grad for d, leaf in leaves.items()})
    assert (event is not None) == overlap
    if event is not None:
        event.synchronize()
    assert all(t.device.type == "cpu" and (not overlap or t.is_pinned()) for t in host.values())


@cuda
def test_an_nccl_rank_runs_every_collective_on_a_backend_that_serves_it(tmp_path):
    from tests.unit.control_group_ranks import nccl_rank_main

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=nccl_rank_main, args=(free_port(), str(tmp_path)), daemon=True)
    proc.start()
    proc.join(TIMEOUT_S)
    errors = "\n".join(f.read_text() for f in tmp_path.glob("*.err"))
    assert proc.exitcode == 0, errors
    result = json.loads((tmp_path / "nccl.json").read_text())
    assert result["backend"] == "nccl" and result["control_group"] and result["time_up"] is False
    assert result["state_devices"] == {"exp_avg": "cuda", "step": "cpu"}
    assert result["reloaded_on_cpu"] is True
