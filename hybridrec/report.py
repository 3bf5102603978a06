"""The run report of `hybridrec run`: time series sampled by the launcher, plots, one self-contained HTML page.

While the job runs, `Recorder.sample()` (about once a second) records NN rank
0's status (samples, loss, progressive AUC) and every service's CPU and memory
(psutil). At the end `write_report` draws PNGs with matplotlib and inlines them
into report.html (base64 images, no external files or scripts), next to
series.json with the raw numbers.
"""
from __future__ import annotations

import base64
import html
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hybridrec.summary import RunSummary

PLOTS = ("loss_auc", "throughput", "staleness", "resources")


@dataclass
class Recorder:
    started: float = field(default_factory=time.monotonic)
    training: list[dict] = field(default_factory=list)
    resources: dict[str, list[dict]] = field(default_factory=dict)
    _procs: dict[int, psutil.Process] = field(default_factory=dict)

    def sample(self, status, services: list[tuple[str, int | None]]) -> None:
        now = round(time.monotonic() - self.started, 3)
        if status is not None and status.phase in ("train", "eval", "done"):
            self.training.append({"t": now, "samples": status.samples, "step": status.step, "loss": status.loss,
                                  "train_auc": status.train_auc, "phase": status.phase})
        for name, pid in services:
            if pid is None:
                continue
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                cpu, rss = proc.cpu_percent(None), proc.memory_info().rss
            except psutil.Error:
                continue
            self.resources.setdefault(name, []).append({"t": now, "cpu_percent": cpu, "rss_bytes": rss})


def _plot_all(series: Recorder, summary: dict, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {name: out / f"{name}.png" for name in PLOTS}
    train = [p for p in series.training if p["phase"] == "train"]
    t = [p["t"] for p in train]

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(t, [p["loss"] for p in train], label="train loss (batch)", color="tab:blue")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(t, [p["train_auc"] for p in train], label="progressive AUC", color="tab:orange")
    if summary.get("auc") is not None:
        ax2.axhline(summary["auc"], color="tab:green", linestyle="--", label=f"eval AUC {summary['auc']:.4f}")
    if summary.get("oracle_auc") is not None:
        ax2.axhline(summary["oracle_auc"], color="grey", linestyle=":", label=f"oracle AUC {summary['oracle_auc']:.4f}")
    ax2.set_ylabel("AUC")
    fig.legend(loc="lower right", fontsize=7)
    ax.set_title("Loss and AUC over time")
    fig.tight_layout()
    fig.savefig(paths["loss_auc"], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    rates = [(b["t"], (b["samples"] - a["samples"]) / (b["t"] - a["t"])) for a, b in zip(train, train[1:])
             if b["t"] > a["t"]]
    ax.plot([r[0] for r in rates], [r[1] for r in rates], color="tab:purple")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("samples/s")
    ax.set_title("Training throughput")
    fig.tight_layout()
    fig.savefig(paths["throughput"], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3))
    hist = summary.get("staleness", {}).get("histogram", [])
    ax.bar(range(len(hist)), hist, color="tab:red")
    ax.set_xlabel("staleness (batches with unapplied updates at lookup)")
    ax.set_ylabel("lookups")
    ax.set_title("Staleness")
    fig.tight_layout()
    fig.savefig(paths["staleness"], dpi=90)
    plt.close(fig)

    fig, (cpu_ax, mem_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, points in sorted(series.resources.items()):
        ts = [p["t"] for p in points]
        cpu_ax.plot(ts, [p["cpu_percent"] for p in points], label=name)
        mem_ax.plot(ts, [p["rss_bytes"] / 2**20 for p in points], label=name)
    cpu_ax.set_title("CPU per service (%)")
    mem_ax.set_title("Resident memory per service (MiB)")
    for a in (cpu_ax, mem_ax):
        a.set_xlabel("wall time (s)")
    mem_ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(paths["resources"], dpi=90)
    plt.close(fig)
    return paths


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>hybridrec run report</title>
<style>body{{font-family:sans-serif;margin:2em}} td{{padding:2px 12px}} img{{display:block;margin:1em 0}}</style>
</head><body data-plots="{num}">
<h1>hybridrec run report</h1>
<table>{rows}</table>
{images}
<script>
window.addEventListener("load", function () {{
  var imgs = document.querySelectorAll("img.plot");
  var ok = Array.prototype.filter.call(imgs, function (i) {{ return i.complete && i.naturalWidth > 0; }});
  document.body.setAttribute("data-rendered", ok.length + "/" + imgs.length);
}});
</script>
</body></html>
"""


def write_report(run_dir: Path, run: RunSummary, series: Recorder) -> Path:
    """Write PNGs, series.json and a self-contained report.html into run_dir; returns the HTML path."""
    summary = run.model_dump(mode="json")
    paths = _plot_all(series, summary, run_dir)
    (run_dir / "series.json").write_text(json.dumps({"training": series.training, "resources": series.resources}))
    keys = ("mode", "steps", "samples", "wall_s", "samples_per_sec", "auc", "oracle_auc", "logloss",
            "skipped_batches", "lost_updates")
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(summary.get(k)))}</td></tr>" for k in keys)
    images = "".join(
        f'<h2>{html.escape(name.replace("_", " "))}</h2><img class="plot" alt="{name}" '
        f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">' for name, path in paths.items())
    page = run_dir / "report.html"
    page.write_text(_PAGE.format(num=len(paths), rows=rows, images=images))
    return page
