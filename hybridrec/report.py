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

    python -m hybridrec.report RUN_DIR [--screenshot docs/report.png]
"""
from __future__ import annotations

import argparse
import base64
import html
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

PLOTS = ("loss_auc", "throughput", "staleness", "resources")
TITLES = {"loss_auc": "Loss and progressive AUC, per NN worker", "throughput": "Training throughput, all NN workers",
          "staleness": "Staleness at lookup", "resources": "CPU and memory per service"}
SERIES_VERSION = 2
DASH = "–"

# Phase boundaries, seconds since launch; a phase runs from the previous boundary (t = 0 first) to its own.
PHASES = (("start-up", "first_step"), ("training", "end_of_training"), ("evaluation", "end_of_eval"),
          ("shutdown", "end"))
PHASE_COLORS = {"start-up": "#9e9e9e", "training": "#4caf50", "evaluation": "#ff9800", "shutdown": "#607d8b"}


# -- formatting for people -----------------------------------------------------------------------
def _num(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) or math.isinf(v) else v


def fmt_int(value: Any, unit: str = "") -> str:
    """1000000 -> '1,000,000' (with ' unit' when given); missing -> '–'."""
    v = _num(value)
    return DASH if v is None else f"{round(v):,}" + (f" {unit}" if unit else "")


def fmt_sig(value: Any, digits: int = 4) -> str:
    """Four significant digits (AUC, log loss): 0.752331 -> '0.7523'; missing -> '–'."""
    v = _num(value)
    if v is None:
        return DASH
    if v == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:,.{decimals}f}"


def fmt_duration(value: Any) -> str:
    """Seconds for people: 7.25 -> '7.3 s', 62.4 -> '1 m 02 s', 3725 -> '1 h 02 m 05 s'; missing -> '–'."""
    v = _num(value)
    if v is None or v < 0:
        return DASH
    if v < 59.95:
        return f"{v:.1f} s"
    total = round(v)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h} h {m:02d} m {s:02d} s" if h else f"{m} m {s:02d} s"


def fmt_rate(value: Any) -> str:
    v = _num(value)
    return DASH if v is None else f"{v:,.0f} samples/s"


def _get(tree: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


# -- sampling -----------------------------------------------------------------------------------
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
                cpu, rss = proc.cpu_percent(None), proc.memory_info().rss
            except psutil.Error:
                continue
            self.resources.setdefault(name, []).append({"t": now, "cpu_percent": cpu, "rss_bytes": rss})

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
def phase_spans(phases: dict) -> list[tuple[str, float, float]]:
    """(name, start, end) of every phase whose end is known, from t = 0."""
    spans, start = [], 0.0
    for name, boundary in PHASES:
        end = _num(phases.get(boundary))
        if end is None:
            continue
        if end > start:
            spans.append((name, start, end))
        start = max(start, end)
    return spans


def _shade(ax, phases: dict, *, label: bool, names: bool = False) -> None:
    """Shade each phase; with `names`, write the phase's name at the top of its span when it fits."""
    spans = phase_spans(phases)
    right = max([b for _, _, b in spans] or [1.0])
    for name, a, b in spans:
        ax.axvspan(a, b, color=PHASE_COLORS[name], alpha=0.12, lw=0, label=f"{name} (phase)" if label else None)
        if names and (b - a) / right > 0.08:
            ax.text((a + b) / 2, 0.97, name, transform=ax.get_xaxis_transform(), ha="center", va="top",
                    fontsize=8, color="#444")


def _legend_below(fig, ax, ncol: int = 4) -> None:
    handles, labels = [], []
    for a in fig.axes:
        h, lab = a.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8,
                   frameon=False)


def _xlim(axes, series: Recorder) -> None:
    ends = [_num(v) for v in series.phases.values()] + [p["t"] for p in series.training]
    ends += [p["t"] for pts in series.resources.values() for p in pts]
    right = max([e for e in ends if e is not None] or [1.0])
    for ax in axes:
        ax.set_xlim(0, right * 1.01)


def _plot_all(series: Recorder, summary: dict, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {name: out / f"{name}.png" for name in PLOTS}
    save = dict(dpi=100, bbox_inches="tight")

    # Loss and progressive AUC, one line per rank.
    fig, (loss_ax, auc_ax) = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True)
    train = [p for p in series.training if p["phase"] in ("train", "eval", "done")]
    for rank in range(series.ranks):
        pts = [(p["t"], r) for p in train for r in p["ranks"] if r["rank"] == rank and r["phase"] == "train"]
        color = f"C{rank % 10}"
        loss_ax.plot([t for t, _ in pts], [r["loss"] if r["loss"] is not None else float("nan") for _, r in pts],
                     color=color, lw=1.2, label=f"NN worker {rank}: batch loss / progressive AUC")
        auc_ax.plot([t for t, _ in pts],
                    [r["train_auc"] if r["train_auc"] is not None else float("nan") for _, r in pts],
                    color=color, lw=1.2)
    if _num(summary.get("auc")) is not None:
        auc_ax.axhline(summary["auc"], color="black", ls="--", lw=1,
                       label=f"eval AUC {fmt_sig(summary['auc'])} (held-out file, after training)")
    if _num(summary.get("oracle_auc")) is not None:
        auc_ax.axhline(summary["oracle_auc"], color="grey", ls=":", lw=1.2,
                       label=f"oracle AUC {fmt_sig(summary['oracle_auc'])} (best possible)")
    _shade(loss_ax, series.phases, label=True, names=True)
    _shade(auc_ax, series.phases, label=False)
    loss_ax.set_ylabel("training loss\n(last batch)")
    auc_ax.set_ylabel("AUC")
    auc_ax.set_xlabel("time since launch (s)")
    loss_ax.set_title("Loss and progressive AUC of each NN worker")
    _xlim((loss_ax, auc_ax), series)
    fig.tight_layout()
    _legend_below(fig, auc_ax, ncol=3)
    fig.savefig(paths["loss_auc"], **save)
    plt.close(fig)

    # Throughput of all ranks together.
    fig, ax = plt.subplots(figsize=(11, 3.4))
    intervals = series.throughput()
    if intervals:
        edges = [intervals[0]["t_start"]] + [i["t_end"] for i in intervals]
        ax.stairs([i["samples_per_sec"] for i in intervals], edges, color="tab:purple", lw=1.6,
                  label=f"all {series.ranks} NN workers (samples per poll interval)")
    rate = _num(summary.get("samples_per_sec"))
    if rate is not None:
        ax.axhline(rate, color="black", ls="--", lw=1,
                   label=f"summary: {fmt_rate(rate)} (samples ÷ training time)")
    _shade(ax, series.phases, label=True, names=True)
    ax.set_ylim(bottom=0, top=max([i["samples_per_sec"] for i in intervals] + [rate or 0, 1]) * 1.15)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("time since launch (s)")
    ax.set_ylabel("samples/s (whole run)")
    ax.set_title("Training throughput of the whole run")
    _xlim((ax,), series)
    fig.tight_layout()
    _legend_below(fig, ax, ncol=3)
    fig.savefig(paths["throughput"], **save)
    plt.close(fig)

    # Staleness histogram.
    fig, ax = plt.subplots(figsize=(6, 3))
    hist = _get(summary, "staleness", "histogram") or []
    ax.bar(range(len(hist)), hist, color="tab:red")
    ax.set_xticks(range(len(hist)))
    ax.set_xlabel("earlier batches with unapplied updates at lookup")
    ax.set_ylabel("lookups (all NN workers)")
    ax.set_title("Staleness of the embeddings each batch read")
    if not hist:
        ax.text(0.5, 0.5, "no staleness recorded", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(paths["staleness"], **save)
    plt.close(fig)

    # CPU and memory per service.
    fig, (cpu_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, points in sorted(series.resources.items()):
        ts = [p["t"] for p in points]
        cpu_ax.plot(ts, [p["cpu_percent"] for p in points], lw=1, label=name)
        mem_ax.plot(ts, [p["rss_bytes"] / 2**20 for p in points], lw=1)
    _shade(cpu_ax, series.phases, label=True, names=True)
    _shade(mem_ax, series.phases, label=False, names=True)
    cpu_ax.set_title("CPU per service (100 % = one core)")
    mem_ax.set_title("Resident memory per service (MiB)")
    for a in (cpu_ax, mem_ax):
        a.set_xlabel("time since launch (s)")
        a.set_ylim(bottom=0, top=a.get_ylim()[1] * 1.12)  # room for the phase names
    _xlim((cpu_ax, mem_ax), series)
    fig.tight_layout()
    _legend_below(fig, cpu_ax, ncol=5)
    fig.savefig(paths["resources"], **save)
    plt.close(fig)
    return paths


# -- the page -----------------------------------------------------------------------------------
_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#222;
  background:#fafafa}
main{max-width:1160px;margin:0 auto;padding:1.2em 1.5em 3em}
h1{font-size:1.6em;margin:.3em 0 .2em} h2{font-size:1.2em;margin:1.6em 0 .5em;border-bottom:1px solid #ddd;
  padding-bottom:.2em}
.sub{color:#555;margin:0 0 1em;overflow-wrap:anywhere}
.banner{padding:.7em 1em;border-radius:6px;margin:.8em 0;overflow-wrap:anywhere}
.ok{background:#e8f5e9;border:1px solid #a5d6a7} .bad{background:#ffebee;border:1px solid #ef9a9a}
.grid{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:1.5em;align-items:start}
table{border-collapse:collapse;width:100%;background:#fff;font-size:.92em;table-layout:fixed}
th,td{padding:4px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top;overflow-wrap:anywhere}
td.n{text-align:right;font-variant-numeric:tabular-nums}
th{background:#f0f0f0;font-weight:600}
.bar{display:inline-block;height:.8em;vertical-align:middle;border-radius:2px}
img.plot{display:block;max-width:100%;height:auto;margin:.5em 0 1.2em;background:#fff}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#fff;border:1px solid #ddd;padding:.8em;font-size:.85em}
details summary{cursor:pointer;font-weight:600}
"""

_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.querySelectorAll("img.plot");
  var ok = Array.prototype.filter.call(imgs, function (i) { return i.complete && i.naturalWidth > 0; });
  var over = [];
  document.querySelectorAll("td, th, h1, h2, h3, p, pre, summary, .banner").forEach(function (el) {
    if (el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1) {
      el.setAttribute("data-overflow", "1");
      over.push(el.tagName.toLowerCase() + ":" + (el.textContent || "").trim().slice(0, 40));
    }
  });
  var page = document.documentElement;
  if (page.scrollWidth > page.clientWidth + 1) { over.push("page:" + page.scrollWidth + ">" + page.clientWidth); }
  document.body.setAttribute("data-overflow", String(over.length));
  document.body.setAttribute("data-overflow-list", over.join(" | "));
  document.body.setAttribute("data-height", String(Math.ceil(page.scrollHeight)));
  document.body.setAttribute("data-rendered", ok.length + "/" + imgs.length);
});
"""


def _rows(rows: list[tuple[str, str]], numeric: bool = True) -> str:
    cls = ' class="n"' if numeric else ""
    return "".join(f"<tr><th scope=row>{html.escape(k)}</th><td{cls}>{html.escape(v)}</td></tr>" for k, v in rows)


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The results, formatted for people; a missing field reads '–'."""
    s = summary
    p50, mx = _get(s, "staleness", "p50"), _get(s, "staleness", "max")
    return [
        ("Training mode", str(s.get("mode") or DASH)),
        ("NN workers", fmt_int(s.get("nn_workers"))),
        ("Training samples (all NN workers)", fmt_int(s.get("samples"))),
        ("Training steps (per NN worker)", fmt_int(s.get("steps"))),
        ("Training throughput", fmt_rate(s.get("samples_per_sec"))),
        ("Training time", fmt_duration(s.get("train_wall_s"))),
        ("Whole run (start-up to shutdown)", fmt_duration(s.get("wall_s"))),
        ("Eval AUC (held-out file)", fmt_sig(s.get("auc"))),
        ("Oracle AUC (best possible)", fmt_sig(s.get("oracle_auc"))),
        ("Eval log loss", fmt_sig(s.get("logloss"))),
        ("Eval samples", fmt_int(s.get("eval_samples"))),
        ("Mean training loss", fmt_sig(s.get("mean_train_loss"))),
        ("Staleness at lookup (median / max)", f"{fmt_int(p50)} / {fmt_int(mx)} batches"
         if _num(p50) is not None else DASH),
        ("Skipped training batches", fmt_int(s.get("skipped_batches"))),
        ("Skipped eval batches", fmt_int(s.get("skipped_eval_batches"))),
        ("Lost embedding updates", fmt_int(s.get("lost_updates"))),
    ]


def _phase_table(phases: dict) -> str:
    spans = {name: (a, b) for name, a, b in phase_spans(phases)}
    total = _num(phases.get("end")) or max([b for _, b in spans.values()] or [0.0])
    rows = []
    for name, boundary in PHASES:
        if name in spans:
            a, b = spans[name]
            width = 0 if not total else max(1, round(100 * (b - a) / total))
            bar = f'<span class="bar" style="width:{width}%;background:{PHASE_COLORS[name]}"></span>'
            cells = (fmt_duration(b - a), f"{fmt_duration(a)} → {fmt_duration(b)}", bar)
        else:
            cells = (DASH, DASH, "")
        rows.append(f"<tr><th scope=row>{name}</th><td class=n>{cells[0]}</td><td class=n>{cells[1]}</td>"
                    f"<td>{cells[2]}</td></tr>")
    return ("<table><colgroup><col style='width:24%'><col style='width:20%'><col style='width:30%'><col></colgroup>"
            "<tr><th>phase</th><th>duration</th><th>from → to (since launch)</th><th>share</th></tr>"
            + "".join(rows) + "</table>")


def _services_table(services: Any) -> str:
    if not services:
        return f"<p>{DASH}</p>"
    rows = []
    for s in services:
        name = f"{s.get('name', '?')}-{s.get('replica', '?')}"
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            name, s.get("pid") or DASH, s.get("grpc") or DASH, s.get("metrics") or DASH,
            fmt_int(s.get("restarts")))) + "</tr>")
    return ("<table><tr><th>service</th><th>pid</th><th>gRPC address</th><th>metrics address</th>"
            "<th>restarts</th></tr>" + "".join(rows) + "</table>")


def render_page(summary: dict, series: Recorder, images: dict[str, str], *, config_text: str | None,
                error: str | None, run_dir: str) -> str:
    complete = error is None and bool(summary)
    if complete:
        banner = (f'<div class="banner ok">Complete: {fmt_int(summary.get("samples"))} training samples in '
                  f'{fmt_duration(summary.get("train_wall_s"))} ({fmt_rate(summary.get("samples_per_sec"))}), '
                  f'eval AUC {fmt_sig(summary.get("auc"))}.</div>')
    else:
        first = (error or "the run ended without a summary").splitlines()[0]
        banner = (f'<div class="banner bad"><b>Incomplete run.</b> {html.escape(first)}<br>'
                  f'This report shows what was recorded until then.</div>')
    parts = [f"<h1>hybridrec run report</h1><p class=sub>{html.escape(run_dir)}</p>", banner,
             '<div class="grid"><div><h2>Results</h2><table><colgroup><col style="width:58%"><col></colgroup>',
             _rows(summary_rows(summary)), "</table></div>",
             "<div><h2>Where the time went</h2>", _phase_table(series.phases),
             "<p class=sub>t = 0 at launch. Start-up: processes, process group, first batch; training: first to "
             "last training step (of any NN worker); evaluation: until the NN workers exit; shutdown: stopping "
             "the services.</p></div></div>"]
    for name in PLOTS:
        if name in images:
            parts.append(f'<h2>{html.escape(TITLES[name])}</h2><img class="plot" alt="{html.escape(TITLES[name])}" '
                         f'src="data:image/png;base64,{images[name]}">')
    if error:
        parts.append(f"<h2>What failed</h2><pre>{html.escape(error)}</pre>")
    parts.append("<h2>Services</h2>" + _services_table(summary.get("services")))
    if config_text:
        parts.append(f"<h2>Configuration</h2><details><summary>the resolved config every service loaded "
                     f"(config.yaml)</summary><pre>{html.escape(config_text)}</pre></details>")
    status = "complete" if complete else "incomplete"
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>hybridrec run report</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>'
            f'<body data-plots="{len(images)}" data-status="{status}"><main>{"".join(parts)}</main>'
            f"<script>{_SCRIPT}</script></body></html>")


def write_report(run_dir: Path, run: Any, series: Recorder, *, error: str | None = None,
                 services: list[dict] | None = None) -> Path:
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
        summary["services"] = services
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
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not path:
        raise RuntimeError("headless Chromium is needed (Debian: apt-get install chromium)")
    return path


def chromium_args(profile: Path, width: int, height: int) -> list[str]:
    return [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={width},{height}",
            "--virtual-time-budget=5000"]


def inspect_page(page: Path, width: int = 1280, height: int = 900) -> dict:
    """Load the page in headless Chromium; its script's verdict: images loaded, overflowing boxes, height."""
    import re

    with tempfile.TemporaryDirectory(prefix="hybridrec-chromium-") as profile:
        dom = subprocess.run(chromium_args(Path(profile), width, height) + ["--dump-dom", Path(page).resolve().as_uri()],
                             capture_output=True, text=True, timeout=120)
    body = re.search(r"<body[^>]*>", dom.stdout)
    attrs = dict(re.findall(r'(data-[a-z-]+)="([^"]*)"', body.group(0))) if body else {}
    return {"rendered": attrs.get("data-rendered"), "overflow": attrs.get("data-overflow"),
            "overflow_list": html.unescape(attrs.get("data-overflow-list", "")),
            "height": int(attrs.get("data-height") or 0), "status": attrs.get("data-status"),
            "stderr": dom.stderr[-2000:], "dom": dom.stdout}


def screenshot(page: Path, out: Path, width: int = 1280) -> dict:
    """A full-page PNG of the report at `width` CSS pixels; returns inspect_page's verdict."""
    verdict = inspect_page(page, width)
    height = max(600, min(verdict["height"] or 2000, 16000))
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hybridrec-chromium-") as profile:
        subprocess.run(chromium_args(Path(profile), width, height) + [f"--screenshot={out}",
                                                                       Path(page).resolve().as_uri()],
                       capture_output=True, text=True, timeout=120, check=True)
    return verdict


def rerender(run_dir: Path) -> Path:
    """report.html again from run_dir's series.json, summary.json (if any) and config.yaml."""
    run_dir = Path(run_dir)
    tree = json.loads((run_dir / "series.json").read_text())
    series = Recorder.from_json(tree)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    error = tree.get("error") or (None if summary else "no summary.json: the run did not finish")
    services_path = run_dir / "services.json"
    services = json.loads(services_path.read_text()) if services_path.is_file() else None
    return write_report(run_dir, summary, series, error=error, services=services)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridrec.report", description=__doc__,
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
