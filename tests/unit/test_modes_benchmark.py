"""benchmarks/modes.py: the config it trains with is valid, and its CPU accounting averages the training window."""
from __future__ import annotations

import pytest

from benchmarks.modes import cpu_during, hybridrec_config
from hybridrec.core.config import Mode, load_config


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


def _entry(auc, wall, samples=1_000_000, **extra):
    return {"auc": auc, "train_wall_s": wall, "samples": samples, "samples_per_sec": samples / wall, **extra}


def test_plot_compares_one_auc_measure_for_every_system(tmp_path):
    """Modes and baselines are drawn with the same measure: eval AUC on the held-out file after training.
    The hybridrec progressive curves (a different measure) are not drawn."""
    from benchmarks.modes import AUC_AXIS, auc_points, plot

    result = {
        "modes": {"hybrid": _entry(0.79, 30.0, curve=[(1.0, 0.6), (29.0, 0.9)], curve_kind="progressive"),
                  "sync": _entry(0.78, 60.0, curve=[(1.0, 0.55)], curve_kind="progressive"),
                  "async": {"auc": None, "train_wall_s": 10.0, "samples": 1_000_000}},  # failed eval: left out
        "baselines": {"pytorch": _entry(0.785, 50.0, curve=[(20.0, 0.7), (50.0, 0.785)], curve_kind="eval AUC")},
        "oracle_auc": 0.81,
    }
    points = auc_points(result)
    assert [(p["name"], p["auc"], p["train_wall_s"]) for p in points] == [
        ("hybrid", 0.79, 30.0), ("sync", 0.78, 60.0), ("pytorch", 0.785, 50.0)]
    assert {p["samples"] for p in points} == {1_000_000}
    assert "held-out" in AUC_AXIS and "eval" in AUC_AXIS

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {}
    real_savefig = plt.Figure.savefig

    def capture(fig, *args, **kwargs):
        ax = fig.axes[0]
        drawn["ylabel"] = ax.get_ylabel()
        drawn["lines"] = [([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()]) for line in ax.get_lines()]
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = capture
    try:
        plot(result, tmp_path / "modes.png")
    finally:
        plt.Figure.savefig = real_savefig
    assert (tmp_path / "modes.png").stat().st_size > 5000
    assert drawn["ylabel"] == AUC_AXIS
    # one point per system plus the oracle line; no progressive-AUC curve among them
    points_drawn = [xy for xy in drawn["lines"] if len(xy[0]) == 1]
    assert sorted(points_drawn) == sorted([([30.0], [0.79]), ([60.0], [0.78]), ([50.0], [0.785])])
    assert all(0.6 not in ys and 0.9 not in ys for _, ys in drawn["lines"])


def test_core_seconds_counts_cpu_inside_the_window_and_across_a_restart():
    from benchmarks.modes import core_seconds

    points = [{"t": 0.0, "cpu_s": 10.0}, {"t": 2.0, "cpu_s": 12.0}, {"t": 4.0, "cpu_s": 16.0},
              {"t": 6.0, "cpu_s": 1.0}]  # restarted between t=4 and t=6: its new counter counts from zero
    assert core_seconds(points, 1.0, 4.0) == pytest.approx(1.0 + 4.0)
    assert core_seconds(points, 0.0, 6.0) == pytest.approx(2.0 + 4.0 + 1.0)
    assert core_seconds([{"t": 0.0, "cpu_percent": 5.0}], 0.0, 1.0) == 0.0  # an old series without cpu_s


def test_accounting_sums_replicas_per_service_and_subtracts_the_mlp():
    from benchmarks.modes import accounting

    ramp = lambda rate: [{"t": 0.0, "cpu_s": 0.0}, {"t": 10.0, "cpu_s": 10.0 * rate}]  # noqa: E731
    resources = {"nn_worker-0": ramp(1.0), "nn_worker-1": ramp(1.0), "embedding_ps-0": ramp(0.2),
                 "embedding_ps-1": ramp(0.2), "dataloader-0": ramp(0.5)}
    table = accounting(resources, 0.0, 10.0, samples=2_000_000, mlp_per_1m=6.0)
    assert table["core_s_per_1m"] == {"dataloader": 2.5, "embedding_ps": 2.0, "nn_worker": 10.0, "total": 14.5}
    assert table["nn_worker_outside_mlp_core_s_per_1m"] == 4.0
    assert table["overhead_core_s_per_1m"] == 8.5
    assert "step_core_s_per_1m" not in table  # a summary without the steps' CPU
    table = accounting(resources, 0.0, 10.0, samples=2_000_000, mlp_per_1m=6.0, step_cpu_s=16.0)
    assert table["step_core_s_per_1m"] == 8.0 and table["outside_step_core_s_per_1m"] == 6.5


def test_mlp_reference_is_the_cpu_time_of_a_real_training_step():
    from benchmarks.modes import mlp_core_s_per_1m

    small = mlp_core_s_per_1m(hidden=(16,), batch=256, steps=3)
    large = mlp_core_s_per_1m(hidden=(512, 256, 128), batch=256, steps=3)
    assert 0 < small < large
