"""hybridrec/app/report/write.py: numbers formatted for people, whole-run series, phases, and reports of bad input."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hybridrec.app.report.write import rerender, write_report
from hybridrec.app.report.series import Recorder
from hybridrec.app.report.page import DASH, fmt_duration, fmt_int, fmt_rate, fmt_sig, phase_spans, summary_rows
from hybridrec.core.layouts.summary import Phases, RunSummary, ServiceInfo, Staleness


def test_formatting_for_people():
    assert fmt_int(1_000_000) == "1,000,000"
    assert fmt_int(12, "batches") == "12 batches"
    assert fmt_rate(38512.4) == "38,512 samples/s"
    assert fmt_sig(0.752331) == "0.7523"
    assert fmt_sig(0.47125) == "0.4713" or fmt_sig(0.47125) == "0.4712"
    assert fmt_sig(1.23456) == "1.235"
    assert fmt_sig(0.0001234567) == "0.0001235"
    assert fmt_duration(7.25) == "7.2 s" or fmt_duration(7.25) == "7.3 s"
    assert fmt_duration(41.79636431799986) == "41.8 s"
    assert fmt_duration(62.4) == "1 m 02 s"
    assert fmt_duration(3725) == "1 h 02 m 05 s"
    for fmt in (fmt_int, fmt_sig, fmt_duration, fmt_rate):
        assert fmt(None) == DASH and fmt(float("nan")) == DASH and fmt("garbage") == DASH


def _status(phase, samples, train_s, loss=0.5, auc=0.6):
    return SimpleNamespace(phase=phase, samples=samples, step=samples // 100, loss=loss, train_auc=auc,
                           train_s=train_s)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _recorder(monkeypatch, ranks=2):
    rec = Recorder(ranks=ranks)
    clock = Clock()
    monkeypatch.setattr(rec, "now", clock)
    return rec, clock


def test_series_sum_every_rank_and_place_the_phases(monkeypatch):
    rec, clock = _recorder(monkeypatch)
    polls = [  # t, rank 0, rank 1
        (1.0, None, None),
        (2.0, _status("train", 0, 0.0), _status("train", 0, 0.0)),  # waiting for data: still start-up
        (11.0, _status("train", 1000, 1.0), _status("train", 1100, 1.2)),  # ranks started at 10.0 and 9.8
        (12.0, _status("train", 2000, 2.0), None),  # rank 1 did not answer: its last count stands
        (13.0, _status("train", 3000, 3.0), _status("train", 3100, 3.2)),
        (14.0, _status("eval", 3500, 3.5), _status("eval", 3500, 3.7)),  # both ended at 13.5
    ]
    for t, *statuses in polls:
        clock.t = t
        rec.sample(statuses)
    assert [p["samples"] for p in rec.training] == [0, 2100, 3100, 6100, 7000]
    assert [p["answered"] for p in rec.training] == [2, 2, 1, 2, 2]
    assert rec.phases["first_step"] == pytest.approx(9.8)
    assert rec.phases["end_of_training"] == pytest.approx(13.5)
    assert rec.final_samples == {0: 3500, 1: 3500}
    clock.t = 15.0
    rec.mark("end_of_eval")
    clock.t = 16.0
    rec.mark("end")
    intervals = rec.throughput()
    assert intervals[0]["t_start"] == pytest.approx(9.8) and intervals[-1]["t_end"] == pytest.approx(13.5)
    # The poll rank 1 missed holds its count of a second before: no point of the curve (a dip, then a burst).
    assert [i["t_end"] for i in intervals] == pytest.approx([11.0, 13.0, 13.5])
    assert sum(i["samples"] for i in intervals) == 7000
    assert [name for name, _, _ in phase_spans(rec.phases)] == ["start-up", "training", "evaluation", "shutdown"]

    # The summary's own Unix times and count, when there is one, are exact and take precedence
    # (a later start than the polls saw is a resumed incarnation's: the first start stands).
    rec.settle({"train_started_at": rec.launched_at + 9.7, "train_ended_at": rec.launched_at + 13.4,
                "samples": 7100})
    assert rec.phases["first_step"] == pytest.approx(9.7) and rec.phases["end_of_training"] == pytest.approx(13.4)
    rec.settle({"train_started_at": rec.launched_at + 12.0, "train_ended_at": rec.launched_at + 13.4,
                "samples": 7100})
    assert rec.phases["first_step"] == pytest.approx(9.7)
    assert sum(i["samples"] for i in rec.throughput()) == 7100
    again = Recorder.from_json(json.loads(json.dumps(rec.to_json())))
    assert again.throughput() == rec.throughput() and again.phases == rec.phases


def test_a_poll_is_stamped_when_it_asked_not_when_the_answers_came(monkeypatch):
    rec, clock = _recorder(monkeypatch, ranks=1)
    clock.t = 12.3  # the answers took 1.3 s on a loaded machine
    rec.sample([_status("train", 2000, 2.0)], asked=11.0)
    assert rec.training[0]["t"] == 11.0
    # Its start is placed from the last answer's arrival: late, never before the true start (9.0 to 10.3)
    assert rec.phases["first_step"] == pytest.approx(10.3)


def _summary(**overrides) -> RunSummary:
    fields = dict(mode="hybrid", nn_workers=2, steps=122, samples=1_000_000, train_wall_s=25.9741,
                  samples_per_sec=38_500.123, mean_train_loss=0.51234, lost_updates=0, skipped_batches=0,
                  skipped_eval_batches=0, staleness=Staleness.from_histogram([1, 2, 200]), eval_samples=200_000,
                  auc=0.7523311, logloss=0.4712345, oracle_auc=0.80123, wall_s=62.4, run_dir="runs/x",
                  services=[ServiceInfo(name="nn_worker", replica=0, pid=1, grpc="127.0.0.1:5000",
                                        metrics="127.0.0.1:5001")],
                  phases=Phases(first_step=12.0, end_of_training=38.0, end_of_eval=41.0, end=42.0))
    fields.update(overrides)
    return RunSummary(**fields)


def _sampled(monkeypatch) -> Recorder:
    rec, clock = _recorder(monkeypatch, ranks=1)
    for t, samples, trained in ((1.0, 0, 0.0), (13.0, 38_000, 1.0), (20.0, 300_000, 8.0), (39.0, 1_000_000, 26.0)):
        clock.t = t
        rec.sample([_status("train" if t < 39 else "eval", samples, trained)])
    rec.phases.update(end_of_eval=41.0, end=42.0)
    return rec


def test_report_formats_the_summary(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("training:\n  batch_size: 4096\n")
    page = write_report(tmp_path, _summary(), _sampled(monkeypatch)).read_text()
    for text in ("1,000,000", "38,500 samples/s", "0.7523", "0.4712", "0.8012", "1 m 02 s", "26.0 s",
                 "127.0.0.1:5000", "batch_size: 4096", "Where the time went", "start-up", "Complete"):
        assert text in page, text
    assert "38500.123" not in page and "0.7523311" not in page
    assert 'data-plots="4"' in page and 'data-status="complete"' in page
    series = json.loads((tmp_path / "series.json").read_text())
    assert series["phases"]["first_step"] == pytest.approx(12.0)
    for name in ("loss_auc", "throughput", "staleness", "resources"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000


@pytest.mark.parametrize("summary", [
    None,
    {},
    {"mode": "hybrid", "samples": 5000},  # a summary with most fields missing
    {"auc": "not a number", "staleness": None, "services": None, "samples_per_sec": None, "wall_s": "x"},
])
def test_missing_fields_render_a_dash_never_a_traceback(tmp_path, summary):
    page = write_report(tmp_path, summary, Recorder()).read_text()
    assert DASH in page
    assert "Traceback" not in page
    rows = dict(summary_rows(summary or {}))
    assert rows["Eval AUC (held-out file)"] == DASH
    assert rows["Training throughput"] == DASH


def test_failed_run_report_is_marked_incomplete_and_names_the_service(tmp_path, monkeypatch):
    error = ("service nn_worker-1 (pid 4242) exited with code 1; last lines of logs/nn_worker-1.log:\n"
             "  RuntimeError: planted failure at step 3")
    services = [ServiceInfo(name="nn_worker", replica=1, pid=4242, grpc="127.0.0.1:1")]
    page = write_report(tmp_path, None, _sampled(monkeypatch), error=error, services=services).read_text()
    assert 'data-status="incomplete"' in page and "Incomplete run" in page
    assert "service nn_worker-1 (pid 4242) exited with code 1" in page
    assert "planted failure at step 3" in page
    # and it re-renders from what it wrote
    assert "Incomplete run" in rerender(tmp_path).read_text()


def test_progress_line_counts_every_nn_worker():
    from hybridrec.core.config import load_config
    from hybridrec.app.run.progress import Progress
    from tests.conftest import REPO

    progress = Progress(load_config(REPO / "examples" / "criteo_synth.yaml"), tty=False)
    assert progress._fields() == {"phase": "starting"}
    a = SimpleNamespace(phase="train", samples=500, step=5, loss=0.5, train_auc=0.6, samples_per_sec=100.0)
    b = SimpleNamespace(phase="train", samples=700, step=7, loss=0.3, train_auc=0.8, samples_per_sec=140.0)
    progress([a, b])
    fields = progress._fields()
    assert (fields["samples"], fields["samples/s"], fields["loss"], fields["auc"]) == ("1,200", "240", "0.4000",
                                                                                        "0.7000")
    progress([None, b])  # rank 0 missed a poll: its last answer still counts
    assert progress._fields()["samples"] == "1,200"


def test_a_lost_ps_store_is_said_in_the_results():
    rows = dict(summary_rows({"store_losses": [{"shard": 0, "life": "7", "restored_step": 20, "acknowledged": 42,
                                                "applied_at_checkpoint": 40, "lost": 2},
                                               {"shard": 1, "restored_step": -1, "lost": 9}]}))
    assert rows["PS shard 0 lost its store"] == "restored from the step-20 checkpoint; 2 acknowledged updates lost"
    assert rows["PS shard 1 lost its store"] == "no checkpoint yet: started empty; 9 acknowledged updates lost"
    assert not any("lost its store" in key for key, _ in summary_rows({"store_losses": None}))
