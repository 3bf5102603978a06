"""The whole loop under fire: online multi-task training from a stream, live versions served, and a
chaos process killing training services and restarting the broker, all at once on one machine. Writes JSON
and a PNG plot.

    python benchmarks/soak.py --minutes 10 --out results/soak.json

What it runs:

* synthetic multi-task data (`hybridrec data synth --format parquet --drift-at ROW`: multi-hot tags, a
  behaviour sequence, click and conversion, eight items that drift at ROW, half-way through by default);
* a real nats-server with its store on disk;
* the replay (`hybridrec data replay train.parquet --config`: Arrow record batches of the job's columns) at a
  rate the machine sustains: `--rate`, or `--rate-share` (50 %) of the samples/s of a file run of the same job
  measured first on `--calibrate-rows` rows;
* a stream job of the multi-task example (examples/multitask_parquet.yaml: MMoE, 2 PS shards with
  `ps.replicas: 2`, an embedding worker, 2 NN workers) publishing a version every `--publish-s` (2) seconds,
  below everything else (`--priority`: SCHED_IDLE, or nice 19), with DEBUG logs (each NN worker logs every
  batch it trains);
* `hybridrec serve inference --follow` on the versions (`torch_threads: 1`), at normal priority (its own CPU
  share, as on a host of its own; it is never killed), and a steady OIP client (benchmarks/soak_client.py, a process of its own)
  sending the drift probe rows by feature name at `--client-rps` requests a second and timing every answer;
* the chaos: every `--kill-every-s` (10) seconds a SIGKILL of a training service (the data loader, a PS, the
  embedding worker, an NN worker: the kinds in a shuffled cycle, the replica at random; its pid from the run's
  services.json), each once the previous victim is back at work, until 15 s before the replay's end; and
  `--broker-restarts` (2) times a SIGKILL of nats-server, started again with its store `--broker-down-s` (2)
  seconds later.

Then `hybridrec export` of the run and `hybridrec predict` of the probe rows, and (unless `--no-file-run`)
an undisturbed file run of the same rows. The accounting (printed, in the JSON and the plot):

* events replayed, trained (by event id: every NN worker's `batch_trained` line, or for a rank killed before
  it wrote one its replacement's `batch_settled`, by its position, mapped to the events of the loader's
  `stream_batch` line of that position: each once), acknowledged (the durable
  consumer's floor), skipped, lost; the summary's `stream.events`;
* kills and broker restarts, recoveries per kind (the launcher's, from death to the replacement's first work);
* served requests, errors, latency p50/p99/max (over the whole soak, while the job trained, and the service's
  idle floor: `--idle-s` of answers once the job has ended and its final version is served), versions
  published and swapped in (or passed over: a newer one was complete when the service next looked, as the
  final version written right after the last interval's can be), and the final version's answers against
  `hybridrec predict` of the same model;
* the drifted items' served level against the planted one over time (per task), the control items';
* each task's progressive AUC over the last 100,000 events, against the file run's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.drift import follow  # noqa: E402
from hybridrec.core.runtime import log  # noqa: E402
from hybridrec.app.run.broker import create_stream, spawn_nats_server  # noqa: E402
from hybridrec.app.run.launcher import rank_step  # noqa: E402
from hybridrec.app.run.ports import free_port  # noqa: E402
from hybridrec.core.config import StreamConfig, apply_overrides  # noqa: E402
from hybridrec.core.runtime.log import timestamp_of  # noqa: E402
from hybridrec.core.layouts.summary import RunSummary, read_services  # noqa: E402

HYBRIDREC = [sys.executable, "-m", "hybridrec"]
MULTITASK = REPO / "examples" / "multitask_parquet.yaml"
KINDS = ("dataloader", "embedding_ps", "embedding_worker", "nn_worker")
SUBJECT, STREAM, DURABLE = "hybridrec.events", "HYBRIDREC_EVENTS", "hybridrec-trainer"
MODEL = "soak"
BOUND_S = 30.0
"""The drift: the served level at least halfway to its new level within this many seconds."""
CONTROL_BOUND = 0.01
LATENCY_BOUND_MS = 5.0
AUC_BOUND = 0.005
BEFORE_S = 10.0
"""The served level before the drift: the answers of these seconds before it; the control items' level after it
in windows as long."""
CONTROL_BASELINE_S = 60.0
"""The control items' level before the drift: over this long (a cycle's level also carries the whole model's
move from version to version, 0.005 of std in the soak)."""


def _events(path: Path, event: str) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            out.append(json.loads(line))
    return out


def _count(path: Path, event: str) -> int:
    return path.read_text(errors="replace").count(f'"event": "{event}"') if path.is_file() else 0


def _appended(path: Path, offset: int, event: str) -> bool:
    """Whether `path` has a line of `event` past byte `offset`."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f'"event": "{event}"'.encode() in f.read()


def _cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(HYBRIDREC + args, cwd=REPO, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise RuntimeError(f"hybridrec {' '.join(args[:2])} failed ({out.returncode}): {out.stderr[-3000:]}")
    return out


def job_config(path: Path, data: Path, *, url: str | None = None, until: int | None = None,
               versions: Path | None = None, publish_s: float | None = None,
               overrides: list[str] | None = None) -> Path:
    """The multi-task example with `ps.replicas: 2` and `overrides` (`--set` items): on the stream at `url`
    (until event `until`), publishing every `publish_s` seconds into `versions`; or, without `url`, on the
    training file."""
    tree = yaml.safe_load(MULTITASK.read_text())
    tree["data"].update({"eval": [str(data / "eval.parquet")], "oracle": str(data / "oracle.json")})
    if url is not None:
        tree["data"].update({"train": [], "stream": {"url": url, "until_event": until}})
    else:
        tree["data"]["train"] = [str(data / "train.parquet")]
    tree["ps"]["replicas"] = 2
    if publish_s:
        tree["publish"] = {"interval_s": publish_s, "dir": str(versions), "at_end": True}
    apply_overrides(tree, overrides)
    path.write_text(yaml.safe_dump(tree))
    return path


def _below(priority: str) -> list[str]:
    """The command prefix that runs the training job below the inference service: SCHED_IDLE (it runs on every
    cycle nothing else wants, and a woken normal task takes the CPU from it at once), or nice 19."""
    if priority == "idle" and shutil.which("chrt"):
        return ["chrt", "--idle", "0"]
    return ["nice", "-n", "19"]


def run_file(config: Path, run_dir: Path) -> RunSummary:
    _cli(["run", str(config), "--run-dir", str(run_dir)], timeout=7200)
    return RunSummary.of_run(run_dir)


class Broker:
    """nats-server with JetStream on a fixed port, its store on disk: killed and started again, it comes back
    with its stream, as a restarted broker pod does."""

    def __init__(self, work: Path):
        if shutil.which("nats-server") is None:
            raise SystemExit("nats-server is not installed (Debian package nats-server)")
        self.port, self.store, self.log = free_port(), work / "nats", work / "nats-server.log"
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc = None
        self.restarts: list[dict] = []

    def start(self) -> None:
        self.proc = spawn_nats_server(shutil.which("nats-server"), self.port, self.store, self.log)

    def restart(self, down_s: float) -> None:
        """SIGKILL, then started again with its store `down_s` seconds later."""
        killed = time.time()
        self.proc.kill()
        self.proc.wait(timeout=30)
        time.sleep(down_s)
        self.start()
        self.restarts.append({"killed_at": killed, "back_at": time.time()})

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


class Chaos:
    """Kills a training service every `every_s` seconds (each once the one before is back at work) until
    `kills_until` (wall time), and restarts the broker at `broker_at` (wall times), on two threads."""

    def __init__(self, run_dir: Path, broker: Broker, *, every_s: float, kills_until: float, broker_at: list[float],
                 down_s: float, seed: int):
        self.run_dir, self.broker, self.every_s, self.kills_until = run_dir, broker, every_s, kills_until
        self.broker_at, self.down_s = broker_at, down_s
        self.rng = random.Random(seed)
        self.kills: list[dict] = []
        self.stopped = threading.Event()
        self.problems: list[str] = []
        self._threads = [threading.Thread(target=self._kill_loop, name="chaos-kills", daemon=True),
                         threading.Thread(target=self._broker_loop, name="chaos-broker", daemon=True)]
        self.log = log.get()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self.stopped.set()
        for t in self._threads:
            t.join(timeout=180)

    def _broker_loop(self) -> None:
        for at in self.broker_at:
            if self.stopped.wait(max(0.0, at - time.time())):
                return
            self.log.warning("chaos_broker_restart", down_s=self.down_s)
            self.broker.restart(self.down_s)

    def _kill_loop(self) -> None:
        while (step := rank_step(self.run_dir)) is None or step < 1:  # training has begun
            if self.stopped.wait(0.5):
                return
        cycle: list[str] = []
        next_at = time.time() + self.every_s
        while not self.stopped.wait(max(0.0, next_at - time.time())):
            if time.time() > self.kills_until:
                return
            if not cycle:
                cycle = list(KINDS)
                self.rng.shuffle(cycle)
            kind = cycle.pop()
            killed = self._kill(kind)
            next_at = max((killed or time.time()) + self.every_s, time.time())

    def _kill(self, kind: str) -> float | None:
        services = [s for s in read_services(self.run_dir) or [] if s.name == kind and s.pid]
        if not services:
            self.problems.append(f"no {kind} in services.json")
            return None
        target = self.rng.choice(services)
        log_path = self.run_dir / "logs" / f"{kind}-{target.replica}.log"
        offset = log_path.stat().st_size if log_path.is_file() else 0  # the replacement appends to the same log
        step = rank_step(self.run_dir)
        killed = time.time()
        try:
            os.kill(target.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.problems.append(f"{kind}-{target.replica} (pid {target.pid}) was gone already")
            return None
        record = {"at": killed, "service": kind, "replica": target.replica, "pid": target.pid, "step": step}
        self.kills.append(record)
        self.log.warning("chaos_kill", service=kind, replica=target.replica, pid=target.pid, step=step)
        deadline = killed + 180
        while not _appended(log_path, offset, "at_work"):  # the replacement has worked: the next may be killed
            if self.stopped.wait(0.2) or time.time() > deadline:
                record["back_after_s"] = None
                if time.time() > deadline:
                    self.problems.append(f"{kind}-{target.replica} not back at work 180 s after its kill")
                return killed
        record["back_after_s"] = round(time.time() - killed, 2)
        return killed


def _wait(what: str, check, deadline_s: float, alive=lambda: True, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        if not alive():
            raise RuntimeError(f"{what}: a process it waits on has ended")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {deadline_s:.0f} s")
        time.sleep(poll_s)


def _ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2):
            return True
    except OSError:
        return False


def _consumer(url: str) -> dict:
    async def ask():
        import nats

        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.consumer_info(STREAM, DURABLE)
            state = (await js.stream_info(STREAM)).state
            return {"ack_floor": info.ack_floor.stream_seq, "ack_pending": info.num_ack_pending,
                    "not_delivered": info.num_pending, "stream_last_seq": state.last_seq,
                    "stream_messages": state.messages}
        finally:
            await nc.close()

    return asyncio.run(ask())


def calibrate(work: Path, rows: int, seed: int, overrides: list[str] | None = None) -> dict:
    """samples/s of a file run of the soak's job on `rows` rows of the same data set."""
    data = work / "calibrate-data"
    _cli(["data", "synth", "--format", "parquet", "--out", str(data), "--rows", str(rows), "--seed", str(seed)])
    summary = run_file(job_config(work / "calibrate.yaml", data, overrides=overrides), work / "calibrate-run")
    return {"rows": rows, "samples_per_sec": summary.samples_per_sec, "train_wall_s": summary.train_wall_s}


# -- the accounting -----------------------------------------------------------------------------------------


def trained_by_id(run_dir: Path, replayed: int) -> dict:
    """Every event trained once? Each NN worker's `batch_trained` lines (loader, seq, rows, position), grouped by
    position (a final round's pieces share one), mapped to the events of the loader's `stream_batch` line of
    that position (a restarted loader reads some again, cut where its predecessor cut them: the same events)."""
    events_at: dict[tuple, list[tuple[int, int]]] = {}
    conflicts = 0
    for entry in _events(run_dir / "logs" / "dataloader-0.log", "stream_batch"):
        key, runs = tuple(entry["position"]), [(first, n) for first, n, _ in entry["events"]]
        if key in events_at and events_at[key] != runs:
            conflicts += 1
        events_at.setdefault(key, runs)
    rows_at: dict[tuple, int] = {}
    seen_batches: dict[tuple[int, int], int] = {}
    logs = sorted((run_dir / "logs").glob("nn_worker-*.log"))
    for path in logs:
        for entry in _events(path, "batch_trained"):
            key = (entry["loader"], entry["seq"])
            seen_batches[key] = seen_batches.get(key, 0) + 1
            rows_at[tuple(entry["position"])] = rows_at.get(tuple(entry["position"]), 0) + entry["rows"]
    # A batch a rank trained in a group step just before it was killed, whose `batch_trained` line died with it:
    # its replacement was sent it again and logged it `batch_settled` (the group's state said it was trained).
    settled_only = {}
    for path in logs:
        for entry in _events(path, "batch_settled"):
            key = (entry["loader"], entry["seq"])
            if key not in seen_batches:
                settled_only[key] = entry
    for key, entry in settled_only.items():
        seen_batches[key] = 1
        rows_at[tuple(entry["position"])] = rows_at.get(tuple(entry["position"]), 0) + entry["rows"]
    seen = np.zeros(max(replayed, 1), np.int64)
    unknown = mismatched = outside = 0
    for key, rows in rows_at.items():
        runs = events_at.get(key)
        if runs is None:
            unknown += rows
            continue
        if sum(n for _, n in runs) != rows:
            mismatched += 1
        for first, n in runs:
            if first < 0 or first + n > replayed:
                outside += n
                continue
            seen[first:first + n] += 1
    return {"events_trained": int((seen[:replayed] > 0).sum()), "events_trained_twice": int((seen > 1).sum()),
            "events_never_trained": int((seen[:replayed] == 0).sum()),
            "each_event_trained_once": bool(replayed and seen.min() == seen.max() == 1),
            "batches_trained": len(seen_batches), "batches_trained_twice": sum(1 for c in seen_batches.values() if c > 1),
            "batches_known_trained_from_their_replacement": len(settled_only),
            "samples_of_unknown_batches": unknown, "batches_whose_rows_differ_from_their_events": mismatched,
            "events_outside_the_replay": outside, "batch_positions_read_differently": conflicts}


def skipped_events(run_dir: Path) -> int:
    by_seq = {e["seq"]: e.get("events") or 0 for e in _events(run_dir / "logs" / "dataloader-0.log",
                                                                 "stream_message_skipped")}
    return sum(by_seq.values())


def recoveries(summary: RunSummary, kills: list[dict]) -> dict:
    out = {}
    for kind in KINDS:
        mine = [r for r in summary.recoveries or [] if r.service == kind]
        seconds = sorted(r.seconds for r in mine if r.seconds is not None)
        out[kind] = {"kills": sum(1 for k in kills if k["service"] == kind), "restarts": len(mine),
                     "actions": sorted({r.action for r in mine}),
                     "recovery_s_p50": round(float(np.median(seconds)), 2) if seconds else None,
                     "recovery_s_max": round(max(seconds), 2) if seconds else None,
                     "not_back": sum(1 for r in mine if r.seconds is None)}
    return out


def _levels(answers: dict, rows_per_id: int, items: int) -> dict:
    """Per whole cycle of `rows_per_id` answered requests (every probe row once): its mean time and each probe
    item's mean served probability per task, (cycles, items, tasks)."""
    ok = answers["version"] >= 0
    sent, request, probs = answers["sent"], answers["request"], answers["probs"]
    cycle = np.cumsum(request == 0) - 1
    times, levels = [], []
    for c in np.unique(cycle[cycle >= 0]):
        mask = cycle == c
        if mask.sum() != rows_per_id or not ok[mask].all():
            continue
        times.append(sent[mask].mean())
        levels.append(probs[mask].mean(0))  # (items, tasks): each item's rows, one per request
    return {"t": np.array(times), "levels": np.array(levels).reshape(len(times), items, -1)}


def drift_analysis(answers: dict, drift: dict, changed_at: float, tasks: list[str]) -> dict:
    n = len(drift["ids"])
    series = _levels(answers, drift["probe_rows_per_id"], n + len(drift["control_ids"]))
    times, levels = series["t"], series["levels"]
    out: dict = {"changed_at": changed_at, "cycles": len(times), "tasks": {}}
    for t, task in enumerate(tasks):
        drifted = levels[:, :n, t].mean(1)
        control = levels[:, n:, t].mean(1)
        together = follow(times, drifted, changed_at, float(np.mean(drift["probe_p_after"][task])), BEFORE_S)
        together["planted_before"] = round(float(np.mean(drift["probe_p_before"][task])), 4)
        per_id = [follow(times, levels[:, j, t], changed_at, drift["probe_p_after"][task][j], BEFORE_S)
                  for j in range(n)]
        before_mask = (times >= changed_at - CONTROL_BASELINE_S) & (times < changed_at)
        control_before = float(control[before_mask].mean()) if before_mask.any() else float("nan")
        # The control level over each BEFORE_S window of the bound after the change, against the window before
        # it: one cycle's level also carries the whole model's move from version to version (`cycle_noise`).
        windows = [control[(times >= changed_at + a) & (times < changed_at + a + BEFORE_S)]
                   for a in np.arange(0, BOUND_S, BEFORE_S)]
        shifts = [abs(float(w.mean()) - control_before) for w in windows if len(w)]
        # The same statistic over the windows of the bound before the change: how far the control level strays
        # without a drift, from the model's own moves.
        null = [abs(float(w.mean()) - control_before) for w in
                (control[(times >= changed_at - a - BEFORE_S) & (times < changed_at - a)]
                 for a in np.arange(0, BOUND_S, BEFORE_S)) if len(w)]
        end = times >= (times[-1] if len(times) else 0) - BEFORE_S
        out["tasks"][task] = {
            "drifted": together, "slowest_id_halfway_after_s": None if any(p["halfway_after_s"] is None for p in per_id)
            else max(p["halfway_after_s"] for p in per_id),
            "control": {"served_before": round(control_before, 4), "planted": round(float(np.mean(drift["control_p"][task])), 4),
                        "max_shift_within_bound_s": round(max(shifts), 4) if shifts else None,
                        "cycle_noise": round(float(control[before_mask].std()), 4) if before_mask.sum() > 1 else None,
                        "max_shift_before_the_drift": round(max(null), 4) if null else None,
                        "windows_after": [round(float(w.mean()) - control_before, 4) for w in windows if len(w)],
                        "shift_at_end": round(float(control[end].mean() - control_before), 4) if end.any() else None},
            "series": {"t": np.round(times - changed_at, 2).tolist(), "drifted": np.round(drifted, 4).tolist(),
                       "control": np.round(control, 4).tolist()}}
    return out


def served(answers: dict, inference_log: Path, run_dir: Path, job_ended_at: float | None = None,
           idle_from: float | None = None) -> dict:
    """The answers' count, errors and latency over the whole soak, and split: while the job trained (sent
    before `job_ended_at`) and the service's idle floor in the same invocation (sent from `idle_from`, once
    the final version was served and the job had gone)."""
    ok = answers["version"] >= 0
    ms = answers["seconds"][ok] * 1e3
    from_schedule = (answers["sent"] - answers["scheduled"] + answers["seconds"])[ok] * 1e3
    span = float(answers["sent"][-1] - answers["sent"][0]) if len(answers["sent"]) > 1 else 0.0
    published = sorted(e["version"] for e in _events(run_dir / "logs" / "nn_worker-0.log", "version_published"))
    swaps = _events(inference_log, "version_swapped")
    swapped = {e["version"] for e in swaps}
    passed_over = {v for e in swaps for v in e.get("passed_over", [])}
    pct = lambda a, q: round(float(np.percentile(a, q)), 3) if len(a) else None  # noqa: E731
    return {"requests": int(len(ok)), "errors": int((~ok).sum()), "error_texts": [str(e) for e in answers["errors"][:5]],
            "rate_per_s": round(len(ok) / span, 1) if span else None,
            "latency_ms": {"p50": pct(ms, 50), "p99": pct(ms, 99), "max": pct(ms, 100)},
            "latency_from_schedule_ms": {"p50": pct(from_schedule, 50), "p99": pct(from_schedule, 99),
                                         "max": pct(from_schedule, 100)},
            "latency_while_training_ms": _split(ms, answers["sent"][ok], None, job_ended_at),
            "latency_idle_floor_ms": _split(ms, answers["sent"][ok], idle_from, None),
            "versions_published": len(published), "versions_swapped": len(swapped),
            "versions_passed_over": sorted(passed_over),
            "published_not_served": sorted(set(published) - swapped - passed_over),
            "versions_answering": len(set(answers["version"][ok].tolist())),
            "versions_skipped": len(_events(inference_log, "version_skipped"))}


def _split(ms: np.ndarray, sent: np.ndarray, start: float | None, end: float | None) -> dict | None:
    """p50 / p99 / max and the count of the answers sent in [start, end) (None: open)."""
    if start is None and end is None:
        return None
    inside = np.ones(len(ms), bool)
    if start is not None:
        inside &= sent >= start
    if end is not None:
        inside &= sent < end
    part = ms[inside]
    if not len(part):
        return {"requests": 0}
    return {"requests": int(len(part)), **{k: round(float(np.percentile(part, q)), 3)
                                           for k, q in (("p50", 50), ("p99", 99), ("max", 100))}}


def final_against_predict(answers: dict, index: np.ndarray, predicted: np.ndarray, final: int) -> dict:
    """The final version's answers against `hybridrec predict` of the same model (the export of the run's final
    checkpoint, which the last version holds): max |difference| over every probe row answered by it."""
    mine = np.flatnonzero(answers["version"] == final)
    worst = 0.0
    for a in mine:
        rows = index[answers["request"][a]]
        worst = max(worst, float(np.abs(answers["probs"][a] - predicted[rows]).max()))
    return {"final_version": final, "answers_compared": int(len(mine)), "max_abs_difference": worst}


def timeline(run_dir: Path, t0: float) -> dict:
    """Events read by the loader and trained by the NN workers over time (seconds from `t0`)."""
    read = [(timestamp_of(e), sum(n for _, n, _ in e["events"]))
            for e in _events(run_dir / "logs" / "dataloader-0.log", "stream_batch")]
    trained = sorted((timestamp_of(e), e["rows"]) for path in sorted((run_dir / "logs").glob("nn_worker-*.log"))
                     for e in _events(path, "batch_trained"))
    return {"trained_t": [round(t - t0, 2) for t, _ in trained], "trained_cum": np.cumsum([n for _, n in trained]).tolist(),
            "read_t": [round(t - t0, 2) for t, _ in read]}


# -- the plot -----------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["t0"]
    fig, axes = plt.subplots(4, 1, figsize=(11, 15), gridspec_kw={"height_ratios": [3, 2.5, 2, 2]})
    drift = result["drift"]
    changed = drift["changed_at"] - t0
    styles = {"click": "-", "conversion": "--"}
    _levels_panel(axes[0], result, changed, styles, zoom=False)
    _levels_panel(axes[1], result, changed, styles, zoom=True)
    ax = axes[0]
    ax.set_title(f"Soak: {result['plan']['minutes']:g} min, {result['plan']['rate']:,.0f} events/s, "
                 f"{len(result['chaos']['kills'])} kills, {len(result['chaos']['broker_restarts'])} broker restarts "
                 f"(dotted: planted levels; below: around the drift)", fontsize=10)
    _rest_of_plot(axes[2:], result, t0)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _levels_panel(ax, result: dict, changed: float, styles: dict, zoom: bool) -> None:
    drift = result["drift"]
    for task, d in drift["tasks"].items():
        t = np.array(d["series"]["t"]) + changed
        ax.plot(t, d["series"]["drifted"], color="black", ls=styles[task], lw=1.6, label=f"{task}: drifted items, served")
        ax.plot(t, d["series"]["control"], color="tab:blue", ls=styles[task], lw=1.2, label=f"{task}: control items, served")
        ax.axhline(d["drifted"]["target"], color="black", ls=":", lw=0.8)
        ax.axhline(d["drifted"]["planted_before"], color="grey", ls=":", lw=0.8)
        ax.axhline(d["control"]["planted"], color="tab:blue", ls=":", lw=0.8)
        if d["drifted"]["halfway_after_s"] is not None:
            ax.axvline(changed + d["drifted"]["halfway_after_s"], color="green", ls=styles[task], lw=1,
                       label=f"{task}: halfway and staying, {d['drifted']['halfway_after_s']:.1f} s after")
    ax.axvline(changed, color="red", lw=1, label="the drift (event time of its first event)")
    ax.axvspan(changed, changed + BOUND_S, color="green", alpha=0.06, label=f"the bound: {BOUND_S:.0f} s")
    ax.set_ylabel("served probability, mean over\nthe items' probe rows")
    if zoom:
        ax.set_xlim(changed - 40, changed + 80)
        ax.set_xlabel("seconds from the job's start (each point: a cycle of every probe row, 2 s at 50 requests/s)")
    else:
        ax.legend(fontsize=7, ncol=2, loc="upper left")


def _rest_of_plot(axes, result: dict, t0: float) -> None:
    import matplotlib.pyplot as plt

    ax = axes[0]
    lat = result["latency_series"]
    ax.plot(lat["t"], lat["ms"], ",", color="tab:purple", alpha=0.5)
    ax.plot(lat["window_t"], lat["window_p99"], color="tab:purple", lw=1.5, label="p99 per 10 s")
    ax.axhline(LATENCY_BOUND_MS, color="red", ls="--", lw=1, label=f"{LATENCY_BOUND_MS:g} ms")
    ax.set_yscale("log")
    ax.set_ylabel("answer latency, ms")
    ax.legend(fontsize=7, loc="upper left")
    colors = {"dataloader": "tab:orange", "embedding_ps": "tab:green", "embedding_worker": "tab:cyan",
              "nn_worker": "tab:red"}
    ax = axes[1]
    tl = result["timeline"]
    ax.plot(tl["trained_t"], np.array(tl["trained_cum"]) / 1e6, color="black", lw=1.2, label="events trained")
    rate, start = result["plan"]["rate"], result["replay"]["started_at"] - t0
    ax.plot([start, start + result["replay"]["events"] / rate], [0, result["replay"]["events"] / 1e6], color="grey",
            ls="--", lw=1, label="events replayed (schedule)")
    ax.set_ylabel("million events")
    ax.set_xlabel("seconds from the job's start")
    for a in axes:
        for k in result["chaos"]["kills"]:
            a.axvline(k["at"] - t0, color=colors[k["service"]], lw=0.6, alpha=0.7)
        for b in result["chaos"]["broker_restarts"]:
            a.axvspan(b["killed_at"] - t0, b["back_at"] - t0, color="red", alpha=0.25)
    handles = [plt.Line2D([], [], color=c, lw=1, label=f"kill: {k}") for k, c in colors.items()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="red", alpha=0.25, label="broker down"))
    axes[1].legend(handles=axes[1].get_legend_handles_labels()[0] + handles, fontsize=7, loc="upper left")


def _latency_series(answers: dict, t0: float) -> dict:
    ok = answers["version"] >= 0
    t, ms = answers["sent"][ok] - t0, answers["seconds"][ok] * 1e3
    edges = np.arange(t.min(), t.max() + 10, 10.0) if len(t) else np.zeros(0)
    window_t, window_p99 = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        inside = ms[(t >= a) & (t < b)]
        if len(inside):
            window_t.append(round(float((a + b) / 2), 1))
            window_p99.append(round(float(np.percentile(inside, 99)), 3))
    step = max(1, len(t) // 20_000)  # the plot's points: every answer up to 20,000
    return {"t": np.round(t[::step], 2).tolist(), "ms": np.round(ms[::step], 3).tolist(), "window_t": window_t,
            "window_p99": window_p99}


# -- the soak -----------------------------------------------------------------------------------------------


def soak(work: Path, *, minutes: float, rate: float | None = None, rate_share: float = 0.5,
         calibrate_rows: int = 500_000, kill_every_s: float = 10.0, broker_restarts: int = 2,
         broker_down_s: float = 2.0, publish_s: float = 2.0, client_rps: float = 50.0, idle_s: float = 20.0,
         seed: int = 37,
         drift_fraction: float = 0.5, priority: str = "idle", file_reference: bool = True,
         overrides: list[str] | None = None) -> dict:
    """Run the soak in `work` (kept); returns the accounting (see the module docstring)."""
    logger = log.get()
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "soak", "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    if rate is None:
        result["calibration"] = calibrate(work, calibrate_rows, seed + 1, overrides)
        rate = round(rate_share * result["calibration"]["samples_per_sec"], -1)
        logger.info("soak_rate", rate=rate, **result["calibration"])
    rows = int(rate * minutes * 60)
    drift_at = int(rows * drift_fraction)
    result["plan"] = {"minutes": minutes, "rate": rate, "rows": rows, "drift_at": drift_at,
                      "kill_every_s": kill_every_s, "broker_restarts": broker_restarts, "publish_s": publish_s,
                      "client_rps": client_rps, "seed": seed, "training_priority": " ".join(_below(priority)),
                      "overrides": overrides or []}
    data = work / "data"
    _cli(["data", "synth", "--format", "parquet", "--out", str(data), "--rows", str(rows), "--seed", str(seed),
          "--drift-at", str(drift_at)], timeout=3600)
    drift = json.loads((data / "oracle.json").read_text())["drift"]
    broker = Broker(work)
    broker.start()
    asyncio.run(create_stream(broker.url, StreamConfig()))
    run_dir, versions = work / "run", work / "run" / "versions"
    config = job_config(work / "soak.yaml", data, url=broker.url, until=rows, versions=versions, publish_s=publish_s,
                        overrides=overrides)
    grpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "HYBRIDREC_LOG_JSON": "1"}
    procs: list[subprocess.Popen] = []
    chaos = None
    replayed: dict = {}
    try:
        inference = subprocess.Popen(HYBRIDREC + ["serve", "inference", "--follow", str(versions), "--set",
                                                  "follow_poll_s=0.2", "--set", f"grpc_port={grpc_port}", "--set",
                                                  f"http_port={http_port}", "--set", f"model_name={MODEL}",
                                                  "--set", "torch_threads=1"],
                                     cwd=REPO, stdout=(work / "inference.log").open("wb"), stderr=subprocess.STDOUT,
                                     env=env)
        procs.append(inference)
        t0 = time.time()
        job = subprocess.Popen(_below(priority) + HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=(work / "run.err").open("wb"),
                               env={**env, "HYBRIDREC_LOG_LEVEL": "DEBUG"})
        procs.append(job)
        loader_log = run_dir / "logs" / "dataloader-0.log"
        _wait("the data loader reads the stream", lambda: _count(loader_log, "stream_reading") > 0, 600,
              alive=lambda: job.poll() is None)

        def replay() -> None:
            started = time.time()
            out = subprocess.run(HYBRIDREC + ["data", "replay", str(data / "train.parquet"), "--to",
                                              f"{broker.url}/{SUBJECT}", "--rate", str(rate), "--config", str(config)],
                                 cwd=REPO, capture_output=True, text=True)
            replayed.update({"started_at": started, "seconds": round(time.time() - started, 2),
                             "returncode": out.returncode, "output": out.stdout.strip(), "stderr": out.stderr[-2000:]})

        replay_started = time.time()
        replaying = threading.Thread(target=replay, name="replay", daemon=True)
        replaying.start()
        planned_s = rows / rate
        chaos = Chaos(run_dir, broker, every_s=kill_every_s, kills_until=replay_started + planned_s - 15,
                      broker_at=[replay_started + planned_s * (k + 1) / (broker_restarts + 1)
                                 for k in range(broker_restarts)], down_s=broker_down_s, seed=seed)
        chaos.start()
        _wait("the inference service serves a first version", lambda: _ready(http_port), 600,
              alive=lambda: inference.poll() is None and job.poll() is None)
        stop_client = work / "client.stop"
        client = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "soak_client.py"), "--grpc",
                                   f"127.0.0.1:{grpc_port}", "--model", MODEL, "--probes",
                                   str(data / drift["probe_file"]), "--config", str(config), "--rows-per-id",
                                   str(drift["probe_rows_per_id"]), "--rps", str(client_rps), "--stop",
                                   str(stop_client), "--out", str(work / "answers.npz")], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=(work / "client.err").open("wb"))
        procs.append(client)
        _wait("the job ends", lambda: job.poll() is not None, planned_s * 4 + 1800, poll_s=1.0)
        job_ended_at = time.time()
        chaos.stop()
        replaying.join(timeout=60)
        if job.returncode != 0:
            raise RuntimeError(f"hybridrec run failed ({job.returncode}): "
                               f"{(work / 'run.err').read_text(errors='replace')[-3000:]}")
        summary = RunSummary.of_run(run_dir)
        final = summary.publish.last_version if summary.publish else None
        swapped = lambda: any(e["version"] == final for e in _events(work / "inference.log", "version_swapped"))  # noqa: E731
        _wait(f"version {final} is served", swapped, 120, alive=lambda: inference.poll() is None)
        idle_from = time.time() + 1.0  # the idle floor: the final version served, nothing trains (1 s to settle)
        # A whole cycle of probe rows from the final version, and at least `idle_s` of the idle floor.
        time.sleep(max(drift["probe_rows_per_id"] / client_rps + 2, idle_s + 1.0))
        stop_client.touch()
        client.wait(timeout=60)
        consumer = _consumer(broker.url)
    finally:
        if chaos is not None:
            chaos.stop()
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        broker.stop()
    logger.info("soak_trained", samples=summary.samples, kills=len(chaos.kills), broker_restarts=len(broker.restarts))
    _cli(["export", str(run_dir), "--out", str(work / "bundle")], timeout=1800)
    _cli(["predict", str(work / "bundle"), str(data / drift["probe_file"]), "--out", str(work / "predicted.parquet")],
         timeout=1800)
    import pyarrow.parquet as pq

    tasks = [t.name for t in summary.tasks or []]
    predicted = np.stack([pq.read_table(work / "predicted.parquet")[task].to_numpy() for task in tasks], 1)
    with np.load(work / "answers.npz") as f:
        answers = {k: f[k] for k in f.files}
    items = len(drift["ids"]) + len(drift["control_ids"])
    index = (np.arange(items)[None, :] * drift["probe_rows_per_id"]
             + np.arange(drift["probe_rows_per_id"])[:, None])
    events = int(re.search(r"published ([\d,]+) events", replayed.get("output", "")).group(1).replace(",", "")) \
        if replayed.get("returncode") == 0 else 0
    by_id = trained_by_id(run_dir, events)
    skipped = skipped_events(run_dir)
    changed_at = next(when for e in _events(run_dir / "logs" / "dataloader-0.log", "stream_batch")
                      for first, n, when in e["events"] if first <= drift_at < first + n)
    stream = summary.stream
    result.update({
        "t0": t0, "replay": {**replayed, "events": events}, "consumer": consumer,
        "events": {"replayed": events, "trained": by_id["events_trained"],
                   "acknowledged_all": consumer["ack_floor"] == consumer["stream_last_seq"]
                   and consumer["ack_pending"] == 0 and consumer["not_delivered"] == 0,
                   "skipped": skipped, "lost": events - by_id["events_trained"] - skipped,
                   "summary_stream_events": stream.events if stream else None, "summary_samples": summary.samples,
                   **by_id},
        "stream": stream.model_dump(exclude={"lag_histogram", "partitions"}) if stream else None,
        "chaos": {"kills": chaos.kills, "broker_restarts": broker.restarts, "problems": chaos.problems,
                  "kills_per_kind": {k: sum(1 for x in chaos.kills if x["service"] == k) for k in KINDS}},
        "recoveries": recoveries(summary, chaos.kills),
        "skipped_batches": summary.skipped_batches, "lost_updates": summary.lost_updates,
        "served": served(answers, work / "inference.log", run_dir, job_ended_at, idle_from),
        "final_against_predict": final_against_predict(answers, index, predicted, final),
        "drift": drift_analysis(answers, drift, changed_at, tasks),
        "progressive": {"stream": {t.name: t.progressive_auc for t in summary.tasks or []},
                        "window": summary.progressive_samples},
        "eval_auc": {"stream": {t.name: t.auc for t in summary.tasks or []}},
        "samples_per_sec": summary.samples_per_sec, "train_wall_s": summary.train_wall_s,
        "latency_series": _latency_series(answers, t0), "timeline": timeline(run_dir, t0),
        "load_after": os.getloadavg()})
    if file_reference:
        reference = run_file(job_config(work / "file.yaml", data, overrides=overrides), work / "file-run")
        result["progressive"]["file"] = {t.name: t.progressive_auc for t in reference.tasks or []}
        result["eval_auc"]["file"] = {t.name: t.auc for t in reference.tasks or []}
        result["file_samples_per_sec"] = reference.samples_per_sec
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> dict:
    """The issue's Done items, each with its figures and whether it holds."""
    ev, served_ = result["events"], result["served"]
    kinds = result["chaos"]["kills_per_kind"]
    out = {
        "1_exactly_once": {"holds": bool(ev["each_event_trained_once"] and ev["acknowledged_all"] and ev["skipped"] == 0
                                         and ev["lost"] == 0 and ev["summary_stream_events"] == ev["replayed"]),
                           "kills": len(result["chaos"]["kills"]), "kinds_killed": kinds,
                           "broker_restarts": len(result["chaos"]["broker_restarts"])},
        "2_served": {"holds": bool(served_["errors"] == 0 and served_["latency_ms"]["p99"] is not None
                                   and served_["latency_ms"]["p99"] <= LATENCY_BOUND_MS
                                   and not served_["published_not_served"]
                                   and result["final_against_predict"]["answers_compared"] > 0
                                   and result["final_against_predict"]["max_abs_difference"] <= 1e-5),
                     "p99_ms": served_["latency_ms"]["p99"], "errors": served_["errors"],
                     "p99_while_training_ms": (served_.get("latency_while_training_ms") or {}).get("p99"),
                     "idle_floor_p99_ms": (served_.get("latency_idle_floor_ms") or {}).get("p99")},
        "3_drift": {}, "4_progressive_auc": {}}
    for task, d in result["drift"]["tasks"].items():
        half = d["drifted"]["halfway_after_s"]
        shift = d["control"]["max_shift_within_bound_s"]
        out["3_drift"][task] = {"holds": half is not None and half <= BOUND_S and shift is not None
                                and shift <= CONTROL_BOUND, "halfway_after_s": half, "control_max_shift": shift,
                                "control_windows_after": d["control"]["windows_after"],
                                "control_max_shift_before_the_drift": d["control"]["max_shift_before_the_drift"],
                                "control_shift_at_end": d["control"]["shift_at_end"]}
    file = result["progressive"].get("file")
    for task, auc in result["progressive"]["stream"].items():
        ref = (file or {}).get(task)
        out["4_progressive_auc"][task] = {"stream": auc, "file": ref,
                                          "difference": None if ref is None or auc is None else round(auc - ref, 4),
                                          "holds": None if ref is None or auc is None else abs(auc - ref) <= AUC_BOUND}
    out["1_exactly_once"]["every_kind_killed"] = all(kinds[k] > 0 for k in KINDS)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the replay lasts")
    parser.add_argument("--rate", type=float, help="replayed events a second (default: --rate-share of a file run's)")
    parser.add_argument("--rate-share", type=float, default=0.5, help="of the calibrating file run's samples/s "
                        "(at 0.6 training fell behind under the soak: its publishing, serving, logs and kills cost "
                        "it about 40 %%)")
    parser.add_argument("--calibrate-rows", type=int, default=500_000)
    parser.add_argument("--kill-every-s", type=float, default=10.0)
    parser.add_argument("--broker-restarts", type=int, default=2)
    parser.add_argument("--broker-down-s", type=float, default=2.0)
    parser.add_argument("--publish-s", type=float, default=2.0)
    parser.add_argument("--client-rps", type=float, default=50.0)
    parser.add_argument("--idle-s", type=float, default=20.0, help="seconds the client keeps asking once the job "
                        "has ended and its final version is served: the service's idle floor, in the same invocation")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--priority", choices=("idle", "nice"), default="idle", help="the training job's: "
                        "SCHED_IDLE (chrt --idle 0) or nice 19; the inference service (torch_threads 1, as "
                        "docs/serving.md advises on a small machine), the replay, the broker and the client run at "
                        "the caller's")
    parser.add_argument("--no-file-run", action="store_true", help="skip the undisturbed file run (criterion 4)")
    parser.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                        help="override a setting of the job (every run of it: calibration, stream, file run), as "
                             "`hybridrec run --set` does; repeatable")
    parser.add_argument("--work", type=Path, help="keep everything here (default: a temporary directory)")
    parser.add_argument("--out", type=Path, required=True, help="JSON; the plot beside it (.png)")
    parser.add_argument("--replot", action="store_true", help="only draw the plot of an existing --out")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hybridrec-soak-") as scratch:
        result = soak(args.work or Path(scratch), minutes=args.minutes, rate=args.rate, rate_share=args.rate_share,
                      calibrate_rows=args.calibrate_rows, kill_every_s=args.kill_every_s,
                      broker_restarts=args.broker_restarts, broker_down_s=args.broker_down_s,
                      publish_s=args.publish_s, client_rps=args.client_rps, idle_s=args.idle_s, seed=args.seed,
                      priority=args.priority,
                      file_reference=not args.no_file_run, overrides=args.overrides)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=float))
    plot(result, args.out.with_suffix(".png"))
    brief = {k: result[k] for k in ("plan", "events", "recoveries", "served", "final_against_predict", "progressive",
                                    "targets")}
    brief["drift"] = {task: {k: v for k, v in d.items() if k != "series"} for task, d in result["drift"]["tasks"].items()}
    print(json.dumps(brief, indent=2, default=float))


if __name__ == "__main__":
    main()
