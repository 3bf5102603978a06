"""The run report's time series (`Recorder`): what the launcher samples about once a second while a job runs —
every NN worker's status, every service's CPU and memory, the run's phases on the launcher's clock — and the
series.json it is written to. The report's page and plots draw it (report_page.py, report_plots.py); this
module imports neither, so the report's modules import in one direction.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

SERIES_VERSION = 2


def num(value: Any) -> float | None:
    """A finite float of `value`, or None (missing, not a number, nan or inf)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) or math.isinf(v) else v


def _status_dict(rank: int, status) -> dict:
    return {"rank": rank, "phase": status.phase, "samples": int(status.samples), "step": int(status.step),
            "loss": num(status.loss), "train_auc": num(status.train_auc), "train_s": round(status.train_s, 3)}


@dataclass
class Recorder:
    """Time series of one run on the launcher's clock (t = 0 at `started`, the launch)."""

    started: float = field(default_factory=time.monotonic)
    launched_at: float = field(default_factory=time.time)
    """Unix time of the launch (t = 0), to place the NN workers' Unix times of the summary."""
    ranks: int = 1
    training: list[dict] = field(default_factory=list)
    """One point per poll: t (when the poll asked), phase (of the group), samples (all ranks; a rank that did
    not answer counts with its last known value), step (largest), answered (ranks that answered this poll),
    ranks (each rank's status as answered, or last known)."""
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

    def sample(self, statuses: list, services: Iterable[tuple[str, int | None]] = (),
               asked: float | None = None) -> None:
        """Record one poll: `statuses[r]` is rank r's TrainingStatus, or None when it did not answer.

        `asked`: when the poll asked (`now()` before the calls; default now). Its point is stamped then,
        not when the last answer came: on a loaded machine the answers can take a second, and a count
        stamped late would place the training it saw after the moment it was trained. A rank's start, its
        answer time less its seconds trained, is placed from now, after every answer: late rather than
        early, so that the earliest estimate (`first_step`) is never before the true start."""
        received = self.now()
        now = received if asked is None else asked
        answered = 0
        for rank, status in enumerate(statuses):
            if status is None or status.phase not in ("train", "eval", "done"):
                continue
            answered += 1
            point = self._last[rank] = _status_dict(rank, status)
            self._place(rank, point, received)
        if answered:
            last = [self._last[r] for r in sorted(self._last)]
            phases = {p["phase"] for p in last}
            group = "train" if "train" in phases or len(last) < self.ranks else ("eval" if "eval" in phases
                                                                                  else "done")
            self.training.append({"t": now, "phase": group, "samples": sum(p["samples"] for p in last),
                                  "step": max(p["step"] for p in last), "answered": answered, "ranks": last})
        self._sample_resources(received, services)

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
            at = num(summary.get(key))
            if at is not None:
                t = round(at - self.launched_at, 3)
                end_of_eval = num(self.phases.get("end_of_eval"))
                t = min(t, end_of_eval) if end_of_eval is not None else t
                seen = num(self.phases.get(boundary))
                # After a group restart the summary's start is the last incarnation's: keep the first one seen.
                self.phases[boundary] = min(t, seen) if boundary == "first_step" and seen is not None else t
        if num(summary.get("samples")) is not None:
            self.end_samples = int(summary["samples"])

    # -- derived ------------------------------------------------------------------------------
    def cumulative(self) -> list[tuple[float, int]]:
        """(t, samples of all ranks) from the first training step to the end of training.

        Starts at (first_step, 0); ends at (end_of_training, all ranks' final count: the summary's, or
        the Status of every rank seen after its training ended), else at the last poll during training.
        Between them, the polls every rank answered: a rank's last known count in a poll it missed is
        older than the poll, and would show a dip followed by a burst that never happened."""
        start, end = self.phases.get("first_step"), self.phases.get("end_of_training")
        if start is None:
            return []
        points = [(start, 0)]
        for p in self.training:
            complete = p.get("answered", self.ranks) == self.ranks  # series.json before `answered`: as it was
            if p["t"] > start and (end is None or p["t"] < end) and p["phase"] == "train" and complete:
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
