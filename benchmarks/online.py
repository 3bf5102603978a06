"""Online training from a stream against training on the file, in one invocation on one machine. Writes JSON.

* `file`: the README example (`examples/criteo_synth.yaml`) trained on its training file: the eval AUC is the
  reference;
* `stream`: the same job with `data.stream`, through a real nats-server started here, while `hybridrec data
  replay` publishes the same training file at `--rate` events a second (the replay starts once the job's data
  loader is reading). Reported: samples/s, the training lag (event time to trained; p50, p99, max), the
  progressive AUC over the last `training.progressive_window` samples (100,000) against the file run's eval
  AUC, and the eval AUC on the same held-out file;
* with `--publish-s S` the stream job also publishes a model version every S seconds, `hybridrec serve
  inference --follow` serves them, and the event-to-served lag is reported: from each event's time to the
  moment the inference service swapped in the first version whose step includes the event's batch (from the
  logs: the loader's `stream_batch` lines in stream order, the publisher's `version_published`, the
  service's `version_swapped`). Measured without kills: the k-th batch read is training batch k.

    python benchmarks/online.py --rows 1000000 --rate 40000 --out results/online.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hybridrec.app.run.broker import create_stream, spawn_nats_server  # noqa: E402
from hybridrec.app.run.ports import free_port  # noqa: E402
from hybridrec.core.config import StreamConfig  # noqa: E402
from hybridrec.core.runtime.log import timestamp_of  # noqa: E402
from hybridrec.core.layouts.summary import RunSummary  # noqa: E402

README_CONFIG = REPO / "examples" / "criteo_synth.yaml"
HYBRIDREC = [sys.executable, "-m", "hybridrec"]


def start_broker(store: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("nats-server")
    if binary is None:
        raise SystemExit("nats-server is not installed (Debian package nats-server)")
    port = free_port()
    store.mkdir(parents=True, exist_ok=True)
    return spawn_nats_server(binary, port, store, store.parent / "nats-server.log"), f"nats://127.0.0.1:{port}"


def run(config: Path, run_dir: Path, *, feed=None) -> dict:
    proc = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    fed = None
    if feed is not None:
        log = run_dir / "logs" / "dataloader-0.log"
        while not (log.is_file() and '"stream_reading"' in log.read_text()):
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        fed = feed()
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"hybridrec run failed ({proc.returncode}):\n{err[-3000:]}")
    s = RunSummary.of_run(run_dir)
    out = {"samples": s.samples, "samples_per_sec": s.samples_per_sec, "auc": s.auc,
           "progressive_auc": s.progressive_auc, "progressive_samples": s.progressive_samples,
           "skipped_batches": s.skipped_batches, "lost_updates": s.lost_updates}
    if s.stream is not None:
        out["stream"] = s.stream.model_dump()
    if fed is not None:
        out["replay"] = fed
    return out


def _log(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            out.append(json.loads(line))
    return out


def served_lag(run_dir: Path, inference_log: Path, ranks: int) -> dict:
    """Event time to served, per event (weighted by samples), from the three logs (see the module docstring)."""
    import numpy as np

    batches = _log(run_dir / "logs" / "dataloader-0.log", "stream_batch")
    published = sorted((e["step"], e["version"]) for e in _log(run_dir / "logs" / "nn_worker-0.log",
                                                               "version_published"))
    swapped = sorted((timestamp_of(e), e["version"]) for e in _log(inference_log, "version_swapped"))
    lags, weights, unserved = [], [], 0
    for seq, batch in enumerate(batches):
        step = seq // ranks + 1  # steps done once this batch is trained
        version = next((v for s, v in published if s >= step), None)
        served = next((t for t, v in swapped if version is not None and v >= version), None)
        for _, n, when in batch["events"]:
            if served is None:
                unserved += n
            else:
                lags.append(served - when)
                weights.append(n)
    if not lags:
        return {"unserved_events": unserved}
    lags, weights = np.array(lags), np.array(weights, np.float64)
    order = np.argsort(lags)
    cdf = np.cumsum(weights[order]) / weights.sum()
    pick = lambda q: float(lags[order][min(np.searchsorted(cdf, q), len(lags) - 1)])  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": float(lags.max()), "versions_published": len(published),
            "versions_served": len(swapped), "unserved_events": unserved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="directory with train.tsv, eval.tsv (data/synth)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic rows when --data is not given")
    parser.add_argument("--rate", type=float, default=40_000.0, help="replayed events a second")
    parser.add_argument("--rows-per-message", type=int, default=100)
    parser.add_argument("--publish-s", type=float, help="publish a version every S seconds and serve it")
    parser.add_argument("--prefill", action="store_true", help="publish the whole file (as fast as the broker "
                        "takes it) before training starts: the stream path's own capacity, without the replay's CPU")
    parser.add_argument("--stream-staleness", type=int, help="training.staleness of the stream job (default: the "
                        "README example's, as the file run)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridrec-online-") as scratch:
        work = Path(scratch)
        data = args.data
        if data is None:
            data = work / "data"
            subprocess.run(HYBRIDREC + ["data", "synth", "--out", str(data), "--rows", str(args.rows)], cwd=REPO,
                           check=True, stdout=subprocess.DEVNULL)
        rows = sum(1 for _ in open(data / "train.tsv", "rb"))
        tree = yaml.safe_load(README_CONFIG.read_text())
        tree["data"] = {"train": [str(data / "train.tsv")], "eval": [str(data / "eval.tsv")]}
        (work / "file.yaml").write_text(yaml.safe_dump(tree))
        result: dict = {"benchmark": "online", "cpus": os.cpu_count(), "rows": rows, "rate": args.rate,
                        "file": run(work / "file.yaml", work / "file")}
        broker, url = start_broker(work / "nats")
        try:
            tree["data"] = {"stream": {"url": url, "until_event": rows}, "eval": [str(data / "eval.tsv")]}
            if args.stream_staleness is not None:
                tree["training"]["staleness"] = args.stream_staleness
                result["stream_staleness"] = args.stream_staleness
            if args.publish_s:
                tree["publish"] = {"interval_s": args.publish_s, "dir": str(work / "versions")}
            (work / "stream.yaml").write_text(yaml.safe_dump(tree))
            asyncio.run(create_stream(url, StreamConfig()))  # the job reads it before the replay begins

            def feed() -> dict:
                started = time.monotonic()
                out = subprocess.run(HYBRIDREC + ["data", "replay", str(data / "train.tsv"), "--to",
                                                  f"{url}/hybridrec.events", "--rate", str(0 if args.prefill else args.rate),
                                                  "--rows-per-message", str(args.rows_per_message)],
                                     cwd=REPO, capture_output=True, text=True, check=True)
                return {"seconds": round(time.monotonic() - started, 2), "output": out.stdout.strip()}

            # The replay runs beside training: started in a thread of its own once the loader reads the stream.
            import threading

            replayed: dict = {}
            starter = lambda: threading.Thread(target=lambda: replayed.update(feed()), daemon=True).start()  # noqa: E731
            inference = None
            if args.publish_s:  # serves each version as it comes (it waits for the first)
                inference = subprocess.Popen(HYBRIDREC + [
                    "serve", "inference", "--follow", str(work / "versions"), "--set", "follow_poll_s=0.2",
                    "--set", f"grpc_port={free_port()}", "--set", f"http_port={free_port()}"], cwd=REPO,
                    stdout=(work / "inference.log").open("wb"), stderr=subprocess.STDOUT,
                    env={**os.environ, "HYBRIDREC_LOG_JSON": "1"})
            try:
                if args.prefill:
                    replayed.update(feed())
                    result["prefilled"] = True
                result["stream"] = run(work / "stream.yaml", work / "stream", feed=None if args.prefill else starter)
                time.sleep(2.0)  # the last version's swap
            finally:
                if inference is not None:
                    inference.terminate()
                    inference.wait()
            result["stream"]["replay"] = replayed
            if args.publish_s:
                result["stream"]["served_lag_s"] = served_lag(work / "stream", work / "inference.log",
                                                               len(tree["cluster"]["nn_workers"]))
        finally:
            broker.terminate()
            broker.wait()
    lag = (result["stream"].get("stream") or {}).get("training_lag_s") or {}
    result["targets"] = {
        "training_lag_p99_s": lag.get("p99"), "training_lag_p99_bound_s": 5.0,
        "progressive_minus_file_eval_auc": (result["stream"]["progressive_auc"] or float("nan"))
        - (result["file"]["auc"] or float("nan")),
        "bound": 0.005,
        "event_to_served_p99_s": (result["stream"].get("served_lag_s") or {}).get("p99"),
        "event_to_served_p99_bound_s": 10.0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("file", "targets")} | {"stream": {
        k: v for k, v in result["stream"].items() if k != "replay"}}, indent=2))


if __name__ == "__main__":
    main()
