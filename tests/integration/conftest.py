"""Runs shared by the tests that only read them, one run instead of one per module (a run's start-up is most
of its cost): `watched_run`, watched from outside while it trains — the sockets its services listen on
(test_exposure), their metrics (test_observability), the run report (test_report, test_observability); and
`exported_run`, trained with fp32 pushes and exported (test_export_e2e, test_serving_e2e).
"""
from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from hybridrec.app.data.synth import synthesize
from tests.conftest import HYBRIDREC, REPO, write_config

WATCH_EVERY_S = 0.5


@dataclass
class WatchedRun:
    run_dir: Path
    summary_json: Path
    returncode: int = -1
    stderr: str = ""
    listening: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    """"service-replica" -> every (address, port) it was seen listening on while the run went on."""
    scrapes: list[dict[tuple[str, int], dict[str, float]]] = field(default_factory=list)
    """Every service's /metrics, parsed (`scrape`), each time all of them answered while both NN workers had
    taken more than two steps, in order."""

    @property
    def summary(self) -> dict:
        return json.loads(self.summary_json.read_text())

    @property
    def series(self) -> dict:
        return json.loads((self.run_dir / "series.json").read_text())


def scrape(address: str) -> dict[str, float]:
    """A Prometheus endpoint's samples, summed over labels per metric name."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def _note_listening(services: list[dict], listening: dict[str, set[tuple[str, int]]]) -> None:
    for svc in services:
        try:
            conns = psutil.Process(svc["pid"]).net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                listening.setdefault(f"{svc['name']}-{svc['replica']}", set()).add((c.laddr.ip, c.laddr.port))


def _note_metrics(services: list[dict], scrapes: list) -> None:
    try:
        scraped = {(s["name"], s["replica"]): scrape(s["metrics"]) for s in services}
    except OSError:  # a service not listening yet, or already gone
        return
    steps = [v.get("hybridrec_nn_worker_steps_total", 0) for (n, _), v in scraped.items() if n == "nn_worker"]
    if len(scraped) == 6 and steps and min(steps) > 2:
        scrapes.append(scraped)


@pytest.fixture(scope="session")
def watched_run(tmp_path_factory, small_data) -> WatchedRun:
    """The small config for 12 epochs of 1,024-row batches (about 700 steps per NN worker: long enough on a
    loaded machine for every metric to move between two scrapes), watched every WATCH_EVERY_S until it ends."""
    tmp = tmp_path_factory.mktemp("watched")
    config = write_config(tmp / "c.yaml", small_data)
    watched = WatchedRun(tmp / "run", tmp / "s.json")
    err = tmp / "run.err"
    with err.open("w") as err_file:
        proc = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(watched.run_dir),
                                             "--summary-json", str(watched.summary_json),
                                             "--set", "training.epochs=12", "--set", "training.batch_size=1024"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                services = json.loads((watched.run_dir / "services.json").read_text())
            except (OSError, ValueError):
                services = []
            _note_listening(services, watched.listening)
            _note_metrics(services, watched.scrapes)
            time.sleep(WATCH_EVERY_S)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        watched.returncode = proc.wait(timeout=600)
        watched.stderr = err.read_text()
    return watched


@dataclass(frozen=True)
class ExportedRun:
    data: Path  # train.tsv, eval.tsv, oracle.json
    config: Path
    run_dir: Path
    bundle: Path
    summary: dict


@pytest.fixture(scope="session")
def exported_run(tmp_path_factory) -> ExportedRun:
    """A run of 20,000 synthetic rows (10,000 eval rows, 1,024-row batches, fp32 pushes) and its bundle
    (`hybridrec export`): what test_export_e2e scores offline and test_serving_e2e serves."""
    tmp = tmp_path_factory.mktemp("exported")
    data = tmp / "data"
    synthesize(data, rows=20_000, eval_rows=10_000, seed=11)
    config = write_config(tmp / "c.yaml", data, training={"batch_size": 1024, "staleness": 2, "prefetch": 2,
                                                          "compression": {"fp16": False}})
    for args in (["run", str(config), "--run-dir", str(tmp / "run")],
                 ["export", str(tmp / "run"), "--out", str(tmp / "bundle")]):
        result = subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    return ExportedRun(data, config, tmp / "run", tmp / "bundle",
                       json.loads((tmp / "run" / "summary.json").read_text()))
