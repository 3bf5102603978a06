"""benchmarks/modes.py: the config it trains with is valid, and its CPU accounting averages the training window."""
from __future__ import annotations

import pytest

from benchmarks.modes import cpu_during, hybridrec_config
from hybridrec.config import Mode, load_config


def test_benchmark_config_loads_with_every_mode_and_override(tmp_path):
    path = hybridrec_config(tmp_path / "data", tmp_path / "config.yaml")
    for mode in ("hybrid", "sync", "async", "shadow"):
        config = load_config(path, [f"training.mode={mode}", "training.precision=bf16"])
        assert config.training.mode == Mode(mode)
    config = load_config(path)
    assert (config.training.batch_size, len(config.cluster.nn_workers), len(config.cluster.ps)) == (4096, 2, 2)
    assert config.optimizer.embedding.name == "adagrad" and config.optimizer.dense.name == "adam"


def test_cpu_during_averages_only_the_training_window():
    resources = {
        "nn_worker-0": [{"t": 0.0, "cpu_percent": 5.0}, {"t": 1.0, "cpu_percent": 90.0},
                        {"t": 2.0, "cpu_percent": 70.0}, {"t": 9.0, "cpu_percent": 1.0}],
        "embedding_ps-0": [{"t": 1.5, "cpu_percent": 10.0}],
        "dataloader-0": [{"t": 8.0, "cpu_percent": 50.0}],  # outside the window: left out
    }
    cpu = cpu_during(resources, 1.0, 2.0)
    assert cpu == {"nn_worker-0": 80.0, "embedding_ps-0": 10.0, "total": 90.0}
    assert cpu_during({}, 0.0, 1.0) == {"total": pytest.approx(0.0)}
