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
from pathlib import Path
from typing import Any


from hybridrec.core.layouts.summary import SUMMARY_FILE, ServiceInfo, read_services
from hybridrec.app.report.page import render_page, screenshot
from hybridrec.app.report.plots import _plot_all
from hybridrec.app.report.series import Recorder

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
