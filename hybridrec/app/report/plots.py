"""The run report's plots (matplotlib, PNG): phases shaded from t = 0, titled in words, legends below the
axes. Drawn by `hybridrec.app.report.write.write_report` from the launcher's `Recorder`."""
from __future__ import annotations

import functools
import threading
from pathlib import Path

from typing import TYPE_CHECKING

from hybridrec.app.report.page import PHASE_COLORS, PLOTS, _get, _num, fmt_rate, fmt_sig, phase_spans

if TYPE_CHECKING:
    from hybridrec.app.report.series import Recorder


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


@functools.cache
def preload_plots() -> threading.Thread:
    """Import matplotlib on a daemon thread, once: the launcher starts it while training runs, so that the
    report, written after every service stopped, does not begin with about a CPU-second of imports."""
    thread = threading.Thread(target=_pyplot, name="import-matplotlib", daemon=True)
    thread.start()
    return thread


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_all(series: Recorder, summary: dict, out: Path) -> dict[str, Path]:
    import matplotlib.ticker

    plt = _pyplot()

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
        mem_ax.plot(ts, [p["pss_bytes"] / 2**20 for p in points], lw=1)
    _shade(cpu_ax, series.phases, label=True, names=True)
    _shade(mem_ax, series.phases, label=False, names=True)
    cpu_ax.set_title("CPU per service (100 % = one core)")
    mem_ax.set_title("Memory per service (MiB, shared pages split)")
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
