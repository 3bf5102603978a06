"""The run report of a real `hybridrec run` tells the truth: its throughput series agrees with the summary,
its phases match the NN workers' own clocks, and it renders cleanly in headless Chromium at 1280 px."""
from __future__ import annotations

import struct

import pytest

from hybridrec.app.run.launcher import SAMPLE_EVERY_S
from hybridrec.app.report.page import inspect_page, screenshot

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(watched_run):
    """The shared watched run (tests/integration/conftest.py): the small config, 12 epochs of 1,024-row batches."""
    assert watched_run.returncode == 0, watched_run.stderr[-3000:]
    return watched_run.run_dir, watched_run.summary, watched_run.series


def test_throughput_series_agrees_with_the_summary(run):
    _, summary, series = run
    intervals = series["throughput"]
    assert intervals, series["phases"]
    rate = summary["samples_per_sec"]
    one_interval = rate * SAMPLE_EVERY_S

    # Integrated, the series is the summary's sample count (all NN workers, not rank 0's half).
    total = sum(i["samples"] for i in intervals)
    assert abs(total - summary["samples"]) <= one_interval, (total, summary["samples"])
    # What the polls themselves saw (every NN worker's Status summed, in the polls every rank answered) climbs
    # to the summary's count, short only by what the group trained after the last training poll: at most one
    # poll interval's worth, or the gap's worth where a loaded machine stretched the last poll cycle (the polls
    # are not timed by training).
    polled = [p for p in series["training"] if p["phase"] == "train" and p["answered"] == summary["nn_workers"]]
    seen = max(p["samples"] for p in polled)
    assert seen <= summary["samples"]
    # A poll that saw less than the whole count asked before training ended (a poll is stamped when it asks):
    # the two clocks (Unix times, launcher polls) agree to ms. A rank still says "train" while it writes the
    # final checkpoint, after its training ended; such a poll has seen the whole count.
    counting = [p for p in polled if p["samples"] < summary["samples"]]
    gap = summary["phases"]["end_of_training"] - counting[-1]["t"]
    assert gap >= -0.1, (gap, counting[-1])
    peak = max(i["samples_per_sec"] for i in intervals)  # not the mean: a slow start drags that down
    assert summary["samples"] - seen <= 1.5 * peak * max(gap, SAMPLE_EVERY_S), (seen, gap, peak)
    assert len(polled[-1]["ranks"]) == summary["nn_workers"]

    # Its mean over the training window is the summary's samples/s.
    window = intervals[-1]["t_end"] - intervals[0]["t_start"]
    assert window == pytest.approx(summary["train_wall_s"], rel=0.05)
    assert total / window == pytest.approx(rate, rel=0.05)


def test_phases_from_t0_agree_with_the_nn_workers_clocks(run):
    _, summary, series = run
    phases = summary["phases"]
    assert phases == series["phases"]
    assert 0 < phases["first_step"] < phases["end_of_training"] <= phases["end_of_eval"] <= phases["end"]
    assert phases["end"] == pytest.approx(summary["wall_s"], abs=0.01)
    # The launcher's own estimate from Status (poll time - seconds trained) matches the summary's Unix times.
    starts = [start for start, _ in series["rank_windows"].values() if start is not None]
    assert min(starts) == pytest.approx(phases["first_step"], abs=0.5)


def test_report_renders_at_desktop_width(run, tmp_path):
    run_dir, summary, _ = run
    png = tmp_path / "report.png"
    verdict = screenshot(run_dir / "report.html", png, width=1280)
    assert verdict["status"] == "complete", verdict["stderr"]
    assert verdict["rendered"] == "4/4", verdict["stderr"]  # every image loaded (naturalWidth > 0)
    assert verdict["overflow"] == "0", verdict["overflow_list"]  # no text wider than its box, no page scroll
    assert verdict["height"] > 1500
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">I", head[16:20])[0] == 1280
    dom = verdict["dom"]
    assert "Where the time went" in dom and f"{summary['samples']:,}" in dom


def test_report_of_a_narrow_window_still_has_no_overflow(run):
    run_dir, _, _ = run
    verdict = inspect_page(run_dir / "report.html", width=800)
    assert verdict["rendered"] == "4/4" and verdict["overflow"] == "0", verdict["overflow_list"]
