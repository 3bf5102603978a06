"""The sweep's verdict: the targets at the fastest rate where sync waits a third of its step, and at every
slower rate where it does."""
from __future__ import annotations

from benchmarks.testbed_sweep import targets


def _run(mode: str, rate: str, samples_per_sec: float, exposed: float, step: float, auc: float = 0.807,
         compute: float = 0.25) -> dict:
    return {"mode": mode, "rate": rate, "samples_per_sec": samples_per_sec, "auc": auc,
            "exposed_fraction": exposed / step, "compute_per_step_s": compute}


RUNS = [
    _run("hybrid", "unshaped", 25_000, 0.003, 0.32), _run("sync", "unshaped", 21_000, 0.09, 0.39),
    _run("async", "unshaped", 26_000, 0.003, 0.31),
    _run("hybrid", "200mbit", 26_000, 0.003, 0.31), _run("sync", "200mbit", 20_500, 0.11, 0.40),
    _run("hybrid", "100mbit", 27_000, 0.003, 0.30, compute=0.29), _run("sync", "100mbit", 20_000, 0.16, 0.41),
    _run("async", "100mbit", 26_000, 0.003, 0.31),
    _run("hybrid", "50mbit", 24_000, 0.04, 0.34), _run("sync", "50mbit", 15_000, 0.28, 0.55),
    _run("async", "50mbit", 23_000, 0.004, 0.35),
]


def test_targets_at_the_fastest_qualifying_rate_and_below():
    t = targets(RUNS)
    assert t["rate"] == "100mbit" and list(t["by_rate"]) == ["100mbit", "50mbit"]  # 200mbit: 0.11/0.40 < 1/3
    assert t["hybrid_over_sync"] == 27_000 / 20_000 and not t["met"]["hybrid_over_sync"]
    assert t["hybrid_compute_over_sync_compute"] == 0.29 / 0.25
    fifty = t["by_rate"]["50mbit"]
    assert fifty["hybrid_over_sync"] == 1.6 and fifty["hybrid_over_own_unshaped"] == 24_000 / 25_000
    assert t["met_at"] == ["50mbit"]


def test_no_qualifying_rate_is_said_so():
    t = targets([r for r in RUNS if r["rate"] in ("unshaped", "200mbit")])
    assert t["rate"] is None and "no rate" in t["note"]
