"""benchmarks/gpu.py's parts that need no GPU: the PyTorch baseline it shares with the CPU benchmark, run on the
CPU with the README example's settings; the GPU utilisation sampler without a source (null and why) and with a
stand-in nvidia-smi; the training window and the targets it records."""
from __future__ import annotations

import math
import stat
import sys
import time

import pytest

from benchmarks import gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hybridrec.app.data.synth import synthesize

    out = tmp_path_factory.mktemp("gpu-bench-synth")
    synthesize(out, rows=20000, eval_rows=5000, seed=1)
    return out


@pytest.fixture
def no_gpu_source(monkeypatch, tmp_path):
    """Neither pynvml nor nvidia-smi, as on a machine without a GPU (whatever this one has)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))


def test_baseline_runs_on_the_cpu_with_the_readme_settings(tiny, no_gpu_source):
    res = gpu.pytorch_gpu(tiny, device="cpu", table_rows=20_000, batch_size=512, max_steps=30, threads=1)
    assert res["details"]["device"] == "cpu" and res["samples"] == 512 * 30
    assert math.isfinite(res["samples_per_sec"]) and res["samples_per_sec"] > 0
    assert res["auc"] > 0.6 and 0 < res["logloss"] < 0.69
    assert res["gpu_busy"]["busy_share"] is None and "nvidia-smi" in res["gpu_busy"]["reason"]


def test_baseline_settings_come_from_the_readme_example():
    kwargs = gpu.baseline_kwargs(gpu.example_config())
    tree = gpu.example_config()
    assert kwargs["hidden"] == tuple(tree["model"]["kwargs"]["hidden"])
    assert kwargs["batch_size"] == tree["training"]["batch_size"] == 4096


def test_sampler_is_null_with_a_reason_without_nvidia_smi(no_gpu_source):
    with gpu.GpuSampler([0], interval_s=0.01) as sampler:
        pass
    got = sampler.summary()
    assert got["busy_share"] is None and got["mean_utilization"] is None and got["source"] is None
    assert "nvidia-smi is not on PATH" in got["reason"] and "pynvml" in got["reason"]


def test_sampler_reads_nvidia_smi(no_gpu_source, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 0\n")  # one GPU, idle: busy share 0, not null
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with gpu.GpuSampler([0], interval_s=0.02) as sampler:
        deadline = time.monotonic() + 10
        while len(sampler.points) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    got = sampler.summary()
    assert got["source"] == "nvidia-smi" and got["samples"] >= 3
    assert got["busy_share"] == 0 and got["mean_utilization"] == 0 and got["reason"] is None


def test_busy_summary_counts_samples_above_zero_in_the_window():
    points = [(1.0, [0, 50]), (2.0, [100, 0]), (3.0, [40, 60]), (9.0, [100, 100])]
    got = gpu.busy_summary(points, [0, 1], window=(1.5, 3.5))
    assert got["samples"] == 2 and got["busy_share"] == 0.75 and got["mean_utilization"] == 50
    assert got["per_gpu"]["0"] == {"busy_share": 1.0, "mean_utilization": 70}
    assert gpu.busy_summary(points, [0, 1], window=(4, 5))["busy_share"] is None


def test_training_window_is_on_the_unix_clock():
    series = {"launched_at": 1000.0, "phases": {"first_step": 5.0, "end_of_training": 65.0}}
    assert gpu.training_window(series) == (1005.0, 1065.0)
    assert gpu.training_window({"launched_at": 1000.0, "phases": {"first_step": 5.0}}) is None


def test_targets_are_recorded_for_the_fastest_nccl_run():
    result = {"cpu": {"auc": 0.800}, "baselines": {"pytorch_gpu": {"samples_per_sec": 250_000}},
              "nccl_overlap": [{"samples_per_sec": 1_200_000, "auc": 0.8015}],
              "nccl_sync_copies": [{"samples_per_sec": 900_000, "auc": 0.7}]}
    got = gpu.targets(result)
    assert got["hybrid_run"] == "nccl_overlap-0"
    assert got["hybrid_samples_per_sec"]["met"] is True
    assert got["hybrid_vs_pytorch_gpu"]["value"] == 4.8 and got["hybrid_vs_pytorch_gpu"]["met"] is True
    assert got["hybrid_minus_cpu_auc"]["value"] == pytest.approx(0.0015) and got["hybrid_minus_cpu_auc"]["met"]
    assert gpu.targets({"cpu": {"auc": 0.8}}) == {}


def test_the_gpu_form_of_the_baseline_pools_as_the_jagged_form_without_a_host_sync():
    """On a GPU the baseline pools each sample's ID as a bag of one weighted by its presence (no count of
    present IDs read on the host); the sums and the gradients equal the jagged form's (run here on the CPU)."""
    import torch

    from benchmarks.baselines import EmbeddingBagDNN

    torch.manual_seed(0)
    model = EmbeddingBagDNN(50, 4, [8])
    idx, present, dense = torch.randint(0, 50, (9, 26)), torch.rand(9, 26) > 0.3, torch.randn(9, 13)
    jagged_out = model(dense, idx, present)
    jagged_out.sum().backward()
    jagged_grads = [t.weight.grad.to_dense().clone() for t in model.tables]
    model.zero_grad(set_to_none=True)
    device_out = model.dnn(dense, model._pooled_on_device(idx, present))
    device_out.sum().backward()
    torch.testing.assert_close(device_out, jagged_out)
    for table, expected in zip(model.tables, jagged_grads):
        torch.testing.assert_close(table.weight.grad.to_dense(), expected)


def test_the_capture_check_runs_on_the_cpu_and_finds_both_steps_alike():
    """`capture_check` on the CPU (the padded step without a graph): the README model's dense parameters after
    the steps of both equal, the last batch in a larger bucket, and the timing fields there."""
    res = gpu.capture_check(device="cpu", steps=6, timed=2, batch_size=512)
    assert res["refused"] is None and res["params_max_diff"] <= 1e-5
    assert res["buckets"] >= 2  # the last batch's extra rows: a bucket of its own
    assert res["grads_max_diff"] < 1.0  # fp16-packed gradients (kappa-scaled: a unit is 1/1024 of a norm)
    assert res["eager_step_ms"] > 0 and res["captured_step_ms"] > 0
