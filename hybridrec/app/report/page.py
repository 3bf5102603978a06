"""The run report's page: numbers formatted for people, the self-contained HTML, and headless Chromium
(render checks, screenshots). The plots are `hybridrec.app.report.plots`; the recorder `hybridrec.app.report.series`,
`write_report` `hybridrec.app.report.write`."""
from __future__ import annotations

import html
import math
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridrec.app.report.series import num as _num
from hybridrec.core.layouts.summary import ServiceInfo, describe_store_loss, task_entries, task_row

if TYPE_CHECKING:
    from hybridrec.app.report.series import Recorder

PLOTS = ("loss_auc", "throughput", "staleness", "resources")
TITLES = {"loss_auc": "Loss and progressive AUC, per NN worker", "throughput": "Training throughput, all NN workers",
          "staleness": "Staleness at lookup", "resources": "CPU and memory per service"}
DASH = "–"

# Phase boundaries, seconds since launch; a phase runs from the previous boundary (t = 0 first) to its own.
PHASES = (("start-up", "first_step"), ("training", "end_of_training"), ("evaluation", "end_of_eval"),
          ("shutdown", "end"))
PHASE_COLORS = {"start-up": "#9e9e9e", "training": "#4caf50", "evaluation": "#ff9800", "shutdown": "#607d8b"}


# -- formatting for people -----------------------------------------------------------------------
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
    return [*_result_rows(summary), *_task_rows(summary), *_store_loss_rows(summary)]


def _store_loss_rows(s: dict) -> list[tuple[str, str]]:
    """Each store a PS shard lost during the run (a lost host), what it restored and what was lost."""
    losses = s.get("store_losses") if isinstance(s.get("store_losses"), list) else []
    return [(f"PS shard {x.get('shard')} lost its store", _store_loss(x)) for x in losses if isinstance(x, dict)]


def _store_loss(loss: dict) -> str:
    return describe_store_loss(_num(loss.get("restored_step")), loss.get("from_replica") is True,
                               fmt_int(loss.get("lost")))


def _task_rows(s: dict) -> list[tuple[str, str]]:
    """A multi-task run's per-task eval results by kind (the top-level ones are the first task's), or a
    regression task's alone."""
    return [_capitalised(task_row(t, fmt_sig)) for t in task_entries(s)]


def _capitalised(row: tuple[str, str]) -> tuple[str, str]:
    return row[0][:1].upper() + row[0][1:], row[1]


def _result_rows(s: dict) -> list[tuple[str, str]]:
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
        ("Eval calibration (mean prediction / rate of positives)", fmt_sig(s.get("calibration"))),
        ("Eval samples", fmt_int(s.get("eval_samples"))),
        ("Mean training loss", fmt_sig(s.get("mean_train_loss"))),
        ("Staleness at lookup (median / max)", f"{fmt_int(p50)} / {fmt_int(mx)} batches"
         if _num(p50) is not None else DASH),
        ("Skipped training batches", fmt_int(s.get("skipped_batches"))),
        ("Skipped eval batches", fmt_int(s.get("skipped_eval_batches"))),
        ("Lost embedding updates", fmt_int(s.get("lost_updates"))),
        ("Batches recovered by restarted embedding workers", fmt_int(s.get("batches_recovered"))),
        ("Re-sent updates the PS shards applied once", fmt_int(s.get("updates_deduplicated"))),
        ("Embedding rows held by the PS at the end", fmt_int(s.get("ps_rows"))),
        ("Rows admitted / rejected / expired (all tables)", _lifecycle_totals(s.get("lifecycle"))),
    ]


def _lifecycle_totals(tables: dict | None) -> str:
    """'admitted / rejected / expired' summed over the summary's per-table lifecycle counters."""
    if not isinstance(tables, dict):
        return DASH
    sums = [sum(int(t.get(f, 0)) for t in tables.values() if isinstance(t, dict))
            for f in ("admitted", "rejected", "expired")]
    return " / ".join(fmt_int(n) for n in sums)


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


def _services_table(services: list[dict] | None) -> str:
    """The summary's services (rows of services.json), read through their model."""
    if not services:
        return f"<p>{DASH}</p>"
    rows = []
    for s in map(ServiceInfo.model_validate, services):
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            f"{s.name}-{s.replica}", s.pid or DASH, s.grpc or DASH, s.metrics or DASH,
            fmt_int(s.restarts))) + "</tr>")
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
