"""The run report of `hybridrec run`: time series sampled by the launcher, plots, one self-contained HTML page.

While the job runs, `Recorder.sample()` (about once a second) records every NN
worker's status (samples, loss, progressive AUC, seconds trained) and every
service's CPU and memory (psutil), and places the run's phases on the
launcher's clock (t = 0 at launch): start-up until the first training step,
training, evaluation until the NN workers exit, shutdown. At the end
`write_report` draws PNGs with matplotlib and inlines them into report.html
(base64 images, no external files or scripts), next to series.json with the
raw numbers. A run that failed part-way gets a report too, marked incomplete.

Every series is the whole run's: the throughput counts the samples of all NN
workers together (so it integrates to the summary's `samples`), and loss and
progressive AUC are drawn one line per NN worker, labelled with its rank.

Re-render a report from a run directory (series.json, summary.json,
config.yaml) and take a screenshot of it with headless Chromium:

    python -m hybridrec.app.report RUN_DIR [--screenshot docs/report.png]
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable


from hybridrec.summary import SUMMARY_FILE, ServiceInfo, read_services
from hybridrec.app.report_page import SERIES_VERSION, _num, render_page, screenshot
from hybridrec.app.report_plots import _plot_all

def _status_dict(rank: int, status) -> dict:
    return {"rank": rank, "phase": status.phase, "samples": int(status.samples), "step": int(status.step),
            "loss": _num(status.loss), "train_auc": _num(status.train_auc), "train_s": round(status.train_s, 3)}


@dataclass
class Recorder:
    """Time series of one run on the launcher's clock (t = 0 at `started`, the launch)."""

    started: float = field(default_factory=time.monotonic)
    launched_at: float = field(default_factory=time.time)
    """Unix time of the launch (t = 0), to place the NN workers' Unix times of the summary."""
    ranks: int = 1
    training: list[dict] = field(default_factory=list)
    """One point per poll: t, phase (of the group), samples (all ranks; a rank that did not answer counts
    with its last known value), step (largest), ranks (each rank's status as answered, or last known)."""
    resources: dict[str, list[dict]] = field(default_factory=dict)
    phases: dict[str, float | None] = field(default_factory=dict)
    """first_step, end_of_training, end_of_eval, end: seconds since launch (None: not reached)."""
    rank_start: dict[int, float] = field(default_factory=dict)
    rank_end: dict[int, float] = field(default_factory=dict)
    final_samples: dict[int, int] = field(default_factory=dict)
    """Each rank's samples once its training ended (from its Status)."""
    end_samples: int | None = None
    """All ranks' samples at the end of training, from the summary (the NN workers' reduced counters)."""
    _last: dict[int, dict] = field(default_factory=dict)
    _procs: dict = field(default_factory=dict)

    def now(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def sample(self, statuses: list, services: Iterable[tuple[str, int | None]] = ()) -> None:
        """Record one poll: `statuses[r]` is rank r's TrainingStatus, or None when it did not answer."""
        now = self.now()
        answered = 0
        for rank, status in enumerate(statuses):
            if status is None or status.phase not in ("train", "eval", "done"):
                continue
            answered += 1
            point = self._last[rank] = _status_dict(rank, status)
            self._place(rank, point, now)
        if answered:
            last = [self._last[r] for r in sorted(self._last)]
            phases = {p["phase"] for p in last}
            group = "train" if "train" in phases or len(last) < self.ranks else ("eval" if "eval" in phases
                                                                                  else "done")
            self.training.append({"t": now, "phase": group, "samples": sum(p["samples"] for p in last),
                                  "step": max(p["step"] for p in last), "ranks": last})
        self._sample_resources(now, services)

    def _place(self, rank: int, point: dict, now: float) -> None:
        """Put rank's training window on the launcher's clock from its seconds trained."""
        trained = point["train_s"]
        if trained <= 0:
            return
        if point["phase"] == "train":
            start = now - trained
            self.rank_start[rank] = min(start, self.rank_start.get(rank, start))
        elif rank not in self.rank_end:
            # Training ended between this poll and the last one: train_s is now final.
            if rank not in self.rank_start:
                self.rank_start[rank] = now - trained
            self.rank_end[rank] = round(self.rank_start[rank] + trained, 3)
            self.final_samples[rank] = point["samples"]
        if self.rank_start:
            self.phases["first_step"] = round(min(self.rank_start.values()), 3)
        if len(self.rank_end) == self.ranks:
            self.phases["end_of_training"] = max(self.rank_end.values())

    def _sample_resources(self, now: float, services: Iterable[tuple[str, int | None]]) -> None:
        import psutil

        for name, pid in services:
            if pid is None:
                continue
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                cpu, pss, times = proc.cpu_percent(None), proc.memory_full_info().pss, proc.cpu_times()
            except psutil.Error:
                continue
            # cpu_s: the process's CPU seconds so far (user + system), for core-seconds per sample (modes benchmark).
            # pss_bytes: the proportional set size, shared pages split among the processes that share them: the
            # services are forked from one parent and share its imported libraries, which the resident set
            # size would count once per service.
            self.resources.setdefault(name, []).append({"t": now, "cpu_percent": cpu, "pss_bytes": pss,
                                                        "cpu_s": round(times.user + times.system, 3)})

    def mark(self, boundary: str) -> None:
        """Record a phase boundary (end_of_eval, end) at the current time."""
        self.phases[boundary] = self.now()

    def settle(self, summary: dict) -> None:
        """Place the training phase exactly, from the Unix times the NN workers put in the summary
        (polls, once a second, may miss a short evaluation altogether)."""
        for key, boundary in (("train_started_at", "first_step"), ("train_ended_at", "end_of_training")):
            at = _num(summary.get(key))
            if at is not None:
                t = round(at - self.launched_at, 3)
                end_of_eval = _num(self.phases.get("end_of_eval"))
                t = min(t, end_of_eval) if end_of_eval is not None else t
                seen = _num(self.phases.get(boundary))
                # After a group restart the summary's start is the last incarnation's: keep the first one seen.
                self.phases[boundary] = min(t, seen) if boundary == "first_step" and seen is not None else t
        if _num(summary.get("samples")) is not None:
            self.end_samples = int(summary["samples"])

    # -- derived ------------------------------------------------------------------------------
    def cumulative(self) -> list[tuple[float, int]]:
        """(t, samples of all ranks) from the first training step to the end of training.

        Starts at (first_step, 0); ends at (end_of_training, all ranks' final count: the summary's, or
        the Status of every rank seen after its training ended), else at the last poll during training."""
        start, end = self.phases.get("first_step"), self.phases.get("end_of_training")
        if start is None:
            return []
        points = [(start, 0)]
        for p in self.training:
            if p["t"] > start and (end is None or p["t"] < end) and p["phase"] == "train":
                points.append((p["t"], p["samples"]))
        if end is not None and self.end_samples is not None:
            points.append((end, self.end_samples))
        elif end is not None and len(self.final_samples) == self.ranks:
            points.append((end, sum(self.final_samples.values())))
        return points

    def throughput(self) -> list[dict]:
        """Samples per second of all ranks together, one interval per pair of consecutive points."""
        points = self.cumulative()
        return [{"t_start": a[0], "t_end": b[0], "samples": b[1] - a[1],
                 "samples_per_sec": round((b[1] - a[1]) / (b[0] - a[0]), 1)}
                for a, b in zip(points, points[1:]) if b[0] > a[0]]

    def to_json(self) -> dict:
        return {"version": SERIES_VERSION, "ranks": self.ranks, "launched_at": self.launched_at,
                "phases": self.phases, "end_samples": self.end_samples,
                "rank_windows": {str(r): [self.rank_start.get(r), self.rank_end.get(r)]
                                 for r in sorted(set(self.rank_start) | set(self.rank_end))},
                "final_samples": {str(r): v for r, v in sorted(self.final_samples.items())},
                "throughput": self.throughput(), "training": self.training, "resources": self.resources}

    @classmethod
    def from_json(cls, tree: dict) -> "Recorder":
        rec = cls(ranks=int(tree.get("ranks") or 1), training=list(tree.get("training") or []),
                  launched_at=float(tree.get("launched_at") or 0.0), end_samples=tree.get("end_samples"),
                  resources=dict(tree.get("resources") or {}), phases=dict(tree.get("phases") or {}))
        for r, (start, end) in (tree.get("rank_windows") or {}).items():
            if start is not None:
                rec.rank_start[int(r)] = start
            if end is not None:
                rec.rank_end[int(r)] = end
        rec.final_samples = {int(r): v for r, v in (tree.get("final_samples") or {}).items()}
        return rec


# -- plots --------------------------------------------------------------------------------------
def write_report(run_dir: Path, run: Any, series: Recorder, *, error: str | None = None,
                 services: list[ServiceInfo] | None = None) -> Path:
    """Write PNGs, series.json and a self-contained report.html into run_dir; returns the HTML path.

    `run` is a RunSummary, a dict (possibly partial) or None (a run that failed before rank 0 wrote
    one); `error` marks the report incomplete and says what failed."""
    run_dir = Path(run_dir)
    if run is None:
        summary: dict = {}
    elif isinstance(run, dict):
        summary = dict(run)
    else:
        summary = run.model_dump(mode="json")
    if services is not None and not summary.get("services"):
        summary["services"] = [s.model_dump(mode="json") for s in services]
    (run_dir / "series.json").write_text(json.dumps({**series.to_json(), "error": error}))
    images: dict[str, str] = {}
    try:
        paths = _plot_all(series, summary, run_dir)
        images = {name: base64.b64encode(path.read_bytes()).decode() for name, path in paths.items()}
    except Exception as exc:  # a plot must never cost the report
        error = (error + "\n\n" if error else "") + f"plots failed: {type(exc).__name__}: {exc}"
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(errors="replace") if config_path.is_file() else None
    page = run_dir / "report.html"
    page.write_text(render_page(summary, series, images, config_text=config_text, error=error,
                                run_dir=str(run_dir)))
    return page


# -- re-render and screenshot -------------------------------------------------------------------
def rerender(run_dir: Path) -> Path:
    """report.html again from run_dir's series.json, summary.json (if any) and config.yaml."""
    run_dir = Path(run_dir)
    tree = json.loads((run_dir / "series.json").read_text())
    series = Recorder.from_json(tree)
    summary_path = run_dir / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    error = tree.get("error") or (None if summary else "no summary.json: the run did not finish")
    services = read_services(run_dir)
    return write_report(run_dir, summary, series, error=error, services=services)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridrec.app.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a `hybridrec run` directory (series.json, summary.json)")
    ap.add_argument("--screenshot", type=Path, metavar="PNG", help="also save a 1280 px wide screenshot here")
    ap.add_argument("--width", type=int, default=1280)
    args = ap.parse_args(argv)
    page = rerender(args.run_dir)
    print(page)
    if args.screenshot:
        verdict = screenshot(page, args.screenshot, args.width)
        print(f"{args.screenshot}: images {verdict['rendered']}, overflowing boxes {verdict['overflow']}"
              f"{' (' + verdict['overflow_list'] + ')' if verdict['overflow_list'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
