"""Online training from a real NATS JetStream stream (`data.stream`, services/dataloader/stream.py): a file
replayed through a real nats-server (`hybridrec data replay`) is trained once, every message is acknowledged,
a second job goes on after the first, and a data loader killed mid-stream resumes without skipping or
repeating an event. Needs the nats-server binary (Debian package nats-server)."""
from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from hybridrec.app.run.broker import spawn_nats_server
from hybridrec.app.run.launcher import rank_step
from hybridrec.app.run.ports import free_port
from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration

SUBJECT, STREAM, DURABLE = "hybridrec.events", "HYBRIDREC_EVENTS", "hybridrec-trainer"


class Broker:
    """A real nats-server with JetStream on a free loopback port, its store in a directory that outlives it:
    killed and started again, it comes back with its stream, as a restarted broker pod does."""

    def __init__(self, tmp_path: Path):
        binary = shutil.which("nats-server")
        if binary is None:
            pytest.fail("nats-server is not installed: it is the broker of data.stream (Debian package nats-server)")
        self.binary, self.store, self.log = binary, tmp_path / "nats", tmp_path / "nats.log"
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        self.proc = spawn_nats_server(self.binary, self.port, self.store, self.log)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture
def nats_server(tmp_path):
    server = Broker(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def broker(nats_server) -> str:
    return nats_server.url


def _replay(url: str, path: Path, *, limit: int, first_event: int = 0) -> str:
    out = subprocess.run(_replay_args(url, path, "--limit", str(limit), "--first-event", str(first_event)),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _replay_at(url: str, path: Path, *, limit: int, first_event: int, rate: int = 10_000) -> subprocess.Popen:
    """`hybridrec data replay` at `rate` events/s (0: at once) in the background."""
    return subprocess.Popen(_replay_args(url, path, "--limit", str(limit), "--first-event", str(first_event),
                                         rate=rate),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _config(tmp_path: Path, data: Path, url: str | None, until: int | None, **stream) -> Path:
    """The small test job, trained on the stream instead of its training file (evaluated on its eval file);
    `url` or `until` None: that key left out (a broker of the run's own; no end)."""
    path = write_config(tmp_path / "config.yaml", data)
    tree = yaml.safe_load(path.read_text())
    tree["data"]["train"] = []
    tree["data"]["stream"] = {k: v for k, v in (("url", url), ("until_event", until)) if v is not None} | stream
    path.write_text(yaml.safe_dump(tree))
    return path


def _start(config: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """`hybridrec run` in the background: (process, run dir, its stderr file); the summary in tmp_path."""
    run_dir, err = tmp_path / "run", tmp_path / "run.err"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir), "--summary-json",
                                         str(tmp_path / "summary.json")], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=err.open("wb"))
    return proc, run_dir, err


def _run(config: Path, run_dir: Path, kill: str | None = None, at_step: int = 4, broker: Broker | None = None,
         down_s: float = 3.0, replay: tuple[str, Path, int] | None = None) -> dict:
    """`hybridrec run`; with `kill`, that service's replica 0 SIGKILLed once rank 0 is at `at_step` (the
    launcher replaces it), or with kill="broker" the broker, started again with its store `down_s` later. With
    `replay` (url, file, events), the file is replayed at 10,000 events/s from the moment the data loader
    reads the stream; with a kill, its first half at once, then the kill (the loader has nothing new to send:
    a quiet stream), then its second half once training has caught up with the first: the kill comes in the
    middle of the replay however slowly a loaded machine trains."""
    if replay is not None:
        from hybridrec.app.run.broker import create_stream
        from hybridrec.core.config import StreamConfig

        asyncio.run(create_stream(replay[0], StreamConfig()))
    summary = run_dir / "summary-out.json"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir), "--summary-json",
                                         str(summary)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    replaying, rest = None, None
    if replay is not None:
        url, path, limit = replay
        first = limit // 2 if kill is not None else limit
        if first < limit:
            rest = run_dir.parent / f"{path.stem}-from-{first}{path.suffix}"
            with path.open() as lines, rest.open("w") as out:
                out.writelines(itertools.islice(lines, first, limit))
        log = run_dir / "logs" / "dataloader-0.log"
        while not (log.is_file() and '"stream_reading"' in log.read_text()):
            assert proc.poll() is None, "the run ended before it read the stream"
            time.sleep(0.05)
        replaying = _replay_at(url, path, limit=first, first_event=0, rate=0 if rest is not None else 10_000)
        if rest is not None:
            assert replaying.wait(timeout=300) == 0, replaying.stderr.read()[-3000:]
    if kill is not None:
        while (step := rank_step(run_dir)) is None or step < at_step:
            assert proc.poll() is None, "the run ended before the kill"
            time.sleep(0.05)
        if kill == "broker":
            broker.kill()
            time.sleep(down_s)
            broker.start()
        else:
            pattern = f"serve {kill} --config {run_dir / 'config.yaml'} --replica 0"
            (target,) = [p for p in psutil.process_iter(["cmdline"]) if pattern in " ".join(p.info["cmdline"] or [])]
            target.send_signal(signal.SIGKILL)
    if replaying is not None:
        assert replaying.wait(timeout=300) == 0, replaying.stderr.read()[-3000:]
    if rest is not None:
        # Training goes on with the events read before the kill, without waiting for more: every full batch of
        # them is trained (a replaced NN worker is sent its predecessor's batches with nothing new to send).
        # Rank 1's step: a replacement of rank 0 joins only when rank 1 next needs its peer, and if the kill
        # came after the last of these steps, that is after the next event.
        tree = yaml.safe_load((run_dir / "config.yaml").read_text())
        steps = first // (tree["training"]["batch_size"] * len(tree["cluster"]["nn_workers"]))
        deadline = time.monotonic() + 120
        while (step := rank_step(run_dir, 1)) is None or step < steps:
            assert proc.poll() is None, "the run ended before the rest of the replay"
            assert time.monotonic() < deadline, f"training stopped at step {step} of {steps} after the kill"
            time.sleep(0.1)
        # the events after the kill, numbered on
        replaying = _replay_at(replay[0], rest, limit=replay[2] - first, first_event=first)
        assert replaying.wait(timeout=300) == 0, replaying.stderr.read()[-3000:]
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(summary.read_text())


def _events_read(run_dir: Path, loader: int = 0) -> list[tuple[int, int]]:
    """The events of every training batch data loader `loader` read, as (first id, count) runs: of a restarted
    loader, what its predecessor read up to where it resumed, then its own (`stream_batch`, `resuming`)."""
    lives: list[tuple[list[int] | None, list[tuple[list[int], list[list[int]]]]]] = []
    resumed_at = None  # a restarted loader logs where it resumes, then starts reading
    for line in (run_dir / "logs" / f"dataloader-{loader}.log").read_text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry["event"] == "resuming":  # after training ended: the predecessor's batches were all trained
            resumed_at = None if entry["train_done"] else entry["position"]
        elif entry["event"] == "stream_reading":
            lives.append((resumed_at, []))
            resumed_at = None
        elif entry["event"] == "stream_batch":
            lives[-1][1].append((entry["position"], entry["events"]))
    runs: list[tuple[int, int]] = []
    for i, (_, batches) in enumerate(lives):
        until = lives[i + 1][0] if i + 1 < len(lives) else None  # where the next loader resumed
        for position, events in batches:
            if until is None or position <= until:
                runs += [(first, n) for first, n, _ in events]
    return runs


def _assert_each_event_once(run_dir: Path, events: int, loaders: int = 1) -> None:
    """The batches read (by every data loader) cover event ids 0..events-1, each exactly once."""
    seen = np.zeros(events, np.int64)
    for first, n in (run for loader in range(loaders) for run in _events_read(run_dir, loader)):
        assert 0 <= first and first + n <= events, (first, n)
        seen[first:first + n] += 1
    assert seen.min() == seen.max() == 1, (np.flatnonzero(seen == 0)[:10], np.flatnonzero(seen > 1)[:10])


def _consumer(url: str) -> tuple[int, int, int]:
    """(ack floor, messages pending acknowledgement, the stream's last sequence)."""
    async def ask():
        import nats

        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.consumer_info(STREAM, DURABLE)
            return info.ack_floor.stream_seq, info.num_ack_pending, (await js.stream_info(STREAM)).state.last_seq
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_a_replayed_file_is_trained_once_a_rerun_reads_nothing_and_a_second_job_goes_on_after_it(
        tmp_path, small_data, broker):
    assert "published 60,000 events (0..59999) in 600 messages" in _replay(broker, small_data / "train.tsv",
                                                                         limit=60_000)
    result = _run(_config(tmp_path, small_data, broker, until=60_000), tmp_path / "run1")
    assert result["samples"] == 60_000 and result["data"]["train"]["rows"] == 60_000, result["data"]
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0 and result["auc"] > 0.6
    assert _consumer(broker) == (600, 0, 600)  # every message acknowledged once all of it was trained
    _assert_each_event_once(tmp_path / "run1", 60_000)
    stream = result["stream"]  # the loader's own account, merged into the summary
    assert stream["events"] == 60_000 and stream["first_seq"] == 1 and stream["acknowledged_through"] == 600, stream
    lag = stream["training_lag_s"]
    assert 0 < lag["p50"] <= lag["p99"] <= lag["max"] < 600, lag
    assert result["progressive_samples"] == 60_000 and 0.5 < result["progressive_auc"] < 1, result

    # The finished job started again in its run directory (a rerun, or a job restarted after it finished)
    # resumes after its last event and ends: it does not wait for events past its end, reads nothing again,
    # and leaves the consumer as it was.
    log = tmp_path / "run1" / "logs" / "dataloader-0.log"
    batches = log.read_text().count('"stream_batch"')
    again = subprocess.run(HYBRIDREC + ["run", str(_config(tmp_path, small_data, broker, until=60_000)),
                                        "--run-dir", str(tmp_path / "run1")],
                           cwd=REPO, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert log.read_text().count('"stream_batch"') == batches  # nothing read again
    assert log.read_text().count('"stream_already_read"') == 1
    assert _consumer(broker) == (600, 0, 600)

    # Twenty thousand more events, numbered on; a new job with the same durable consumer trains only those.
    _replay(broker, small_data / "eval.tsv", limit=20_000, first_event=60_000)
    second = _run(_config(tmp_path, small_data, broker, until=80_000), tmp_path / "run2")
    assert second["samples"] == 20_000 and second["data"]["train"]["rows"] == 20_000, second["data"]
    assert second["stream"]["first_seq"] == 601 and second["stream"]["events"] == 20_000, second["stream"]
    assert _consumer(broker) == (800, 0, 800)


def test_a_loader_killed_mid_replay_resumes_without_skipping_or_repeating(tmp_path, small_data, broker):
    run_dir = tmp_path / "run"
    result = _run(_config(tmp_path, small_data, broker, until=60_000), run_dir, kill="dataloader", at_step=4,
                  replay=(broker, small_data / "train.tsv", 60_000))
    restarts = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarts[("dataloader", 0)] == 1 and restarts[("nn_worker", 0)] == restarts[("nn_worker", 1)] == 0
    resumed = [json.loads(line) for line in (run_dir / "logs" / "dataloader-0.log").read_text().splitlines()
               if '"resuming"' in line]
    assert len(resumed) == 1 and resumed[0]["source"] == "ranks" and resumed[0]["seq"] > 0, resumed
    # Every event trained once: as many samples as events, none skipped.
    assert result["samples"] == 60_000 and result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    _assert_each_event_once(run_dir, 60_000)
    assert _consumer(broker) == (600, 0, 600)
    # The new loader went on with its predecessor's account: the summary covers the whole job.
    stream = result["stream"]
    assert stream["events"] == 60_000 and stream["loader_restarts"] == 1 and stream["first_seq"] == 1, stream
    assert sum(n for _, n in stream["lag_histogram"]) == 60_000, stream
    lag = stream["training_lag_s"]
    assert 0 < lag["p50"] <= lag["p99"] <= lag["max"] < 600, lag


def test_a_stream_that_is_not_there_stops_the_loader_naming_the_key(tmp_path, small_data, broker):
    config = _config(tmp_path, small_data, broker, until=10, stream="NO_SUCH")
    proc = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(tmp_path / "run")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "data.stream.stream: there is no stream 'NO_SUCH'" in proc.stderr, proc.stderr[-3000:]


def test_a_run_without_a_broker_url_starts_its_own_and_says_how_to_feed_it(tmp_path, small_data):
    """No data.stream.url: `hybridrec run` starts nats-server -js for the run (its store in the run directory),
    creates the stream, and logs the replay command; a replay to it is trained; the broker stops with the run."""
    proc, run_dir, err = _start(_config(tmp_path, small_data, None, until=20_000), tmp_path)
    deadline = time.monotonic() + 120
    while not (lines := [json.loads(line) for line in err.read_text().splitlines()
                         if line.startswith("{") and '"local_broker"' in line]):
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.1)
    (started,) = lines
    url = started["url"]
    assert started["feed"] == f"hybridrec data replay FILE --to {url}/{SUBJECT}"
    _replay(url, small_data / "train.tsv", limit=20_000)
    assert proc.wait(timeout=600) == 0, err.read_text()[-3000:]
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["samples"] == 20_000 and result["stream"]["acknowledged_through"] == 200, result["stream"]
    assert (run_dir / "nats").is_dir()
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError):  # stopped with the run
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()


@pytest.mark.parametrize("kill", ["embedding_ps", "embedding_worker", "nn_worker", "broker"])
def test_a_service_or_the_broker_killed_mid_stream_loses_and_repeats_nothing(tmp_path, small_data, nats_server,
                                                                              kill):
    """kill -9 of each other service kind in the middle of a replay (the loader: above), and of the broker,
    started again with its store 3 s later (the replay is published first: a broker lost mid-publish fails the
    publisher, not training): training goes on, every event is trained once, every message is acknowledged."""
    config = _config(tmp_path, small_data, nats_server.url, until=60_000)
    if kill == "broker":
        _replay(nats_server.url, small_data / "train.tsv", limit=60_000)
        result = _run(config, tmp_path / "run", kill=kill, broker=nats_server)
    else:
        result = _run(config, tmp_path / "run", kill=kill, replay=(nats_server.url, small_data / "train.tsv", 60_000))
    restarts = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    if kill != "broker":
        assert restarts[(kill, 0)] == 1, restarts
    assert result["samples"] == 60_000 and result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    _assert_each_event_once(tmp_path / "run", 60_000)
    floor, pending, last = _consumer(nats_server.url)
    assert floor == last == 600, (floor, pending, last)  # every message acknowledged: the next job reads none
    # nats-server 2.9's own bookkeeping: messages it redelivered after its restart can stay counted pending
    # after an acknowledgement of all up to 600 moved the floor past them (344 of 600 in one loaded run). A
    # next job re-creates the consumer after the floor, so they are not read again.
    assert pending == 0 or kill == "broker", (floor, pending, last)


def test_ctrl_c_ends_an_unbounded_stream_with_what_was_read(tmp_path, small_data, broker):
    """No end in the config: training runs until stopped. The first Ctrl-C (SIGINT to `hybridrec run`) ends
    training with the events read, then evaluates and writes the final checkpoint, exit 0; nothing is lost."""
    _replay(broker, small_data / "train.tsv", limit=20_000)
    proc, run_dir, err = _start(_config(tmp_path, small_data, broker, until=None), tmp_path)
    deadline = time.monotonic() + 300
    while sum(n for first, n in (_events_read(run_dir) if (run_dir / "logs" / "dataloader-0.log").is_file()
                                 else [])) < 20_000:  # every replayed event read: the stream is idle
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 0, err.read_text()[-3000:]
    assert "stream_ending" in err.read_text()
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["samples"] == 20_000 and result["stream"]["acknowledged_through"] == 200, result["stream"]
    assert result["checkpoint"] and Path(result["checkpoint"]).is_dir() and result["auc"] > 0.5, result
    assert _consumer(broker) == (200, 0, 200)


def _with_bad_lines(data: Path, out: Path, rows: int, bad_at: tuple[int, ...]) -> Path:
    """The first `rows` lines of the training file with a malformed line inserted before each line of `bad_at`."""
    lines = (data / "train.tsv").read_bytes().splitlines(keepends=True)[:rows]
    for at in sorted(bad_at, reverse=True):
        lines.insert(at, b"1\tnot a number\tx\n")
    out.write_bytes(b"".join(lines))
    return out


def test_malformed_events_are_counted_skipped_and_acknowledged(tmp_path, small_data, broker):
    """data.bad_lines skip (the default): a message line that does not parse is counted and skipped, the rest of
    its message trains, and every message is acknowledged (none is re-delivered forever)."""
    path = _with_bad_lines(small_data, tmp_path / "bad.tsv", 3_000, bad_at=(150, 1_000, 2_999))
    assert "published 3,003 events (0..3002) in 31 messages" in _replay(broker, path, limit=3_003)
    result = _run(_config(tmp_path, small_data, broker, until=3_003), tmp_path / "run")
    assert result["samples"] == 3_000 and result["skipped_batches"] == 0, result
    assert result["data"]["train"]["bad_lines"] == 3, result["data"]
    assert result["stream"]["acknowledged_through"] == 31, result["stream"]
    assert _consumer(broker) == (31, 0, 31)


def test_a_malformed_event_with_bad_lines_error_stops_the_run_naming_subject_message_and_line(tmp_path,
                                                                                              small_data, broker):
    path = _with_bad_lines(small_data, tmp_path / "bad.tsv", 1_000, bad_at=(250,))
    _replay(broker, path, limit=1_001)
    config = _config(tmp_path, small_data, broker, until=1_001)
    tree = yaml.safe_load(config.read_text())
    tree["data"]["bad_lines"] = "error"
    config.write_text(yaml.safe_dump(tree))
    proc = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(tmp_path / "run")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # Line 51 of message 3: the replay puts 100 lines in a message, and the bad line is the 251st.
    assert f"subject {SUBJECT}, message 3:51:" in proc.stderr, proc.stderr[-3000:]


def test_a_broker_that_never_answers_is_retried_reported_and_named(tmp_path, small_data):
    """Nothing listens at data.stream.url: the loader retries with backoff for cluster.retry_s, logs that it is
    retrying, then stops the run naming the key and the URL; never a silent stall."""
    url = f"nats://127.0.0.1:{free_port()}"
    config = _config(tmp_path, small_data, url, until=1_000)
    tree = yaml.safe_load(config.read_text())
    tree.setdefault("cluster", {})["retry_s"] = 5
    config.write_text(yaml.safe_dump(tree))
    run_dir = tmp_path / "run"
    proc = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"data.stream.url: no NATS broker answers at {url}" in proc.stderr, proc.stderr[-3000:]
    retrying = [json.loads(line) for line in (run_dir / "logs" / "dataloader-0.log").read_text().splitlines()
                if '"stream_unreachable"' in line]
    assert retrying and retrying[0]["url"] == url, retrying


# -- the training data's own columns: Arrow record batches ---------------------------------------------------


@pytest.fixture(scope="module")
def multitask_data(tmp_path_factory) -> Path:
    from hybridrec.app.data.synth_parquet import synthesize_multitask

    out = tmp_path_factory.mktemp("multitask")
    synthesize_multitask(out, rows=20_000, eval_rows=5_000, seed=6)
    return out


MULTITASK = REPO / "examples" / "multitask_parquet.yaml"


def _multitask_config(tmp_path: Path, data: Path, url: str, until: int, **data_keys) -> Path:
    """The multi-task example (MMoE, multi-hot tags, a sequence, two tasks) trained on the stream, evaluated on
    its eval file."""
    tree = yaml.safe_load(MULTITASK.read_text())
    tree["data"].update({"train": [], "eval": [str(data / "eval.parquet")], "oracle": str(data / "oracle.json"),
                         "stream": {"url": url, "until_event": until}, **data_keys})
    tree["ps"]["capacity"] = 100_000
    path = tmp_path / "multitask.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _replay_args(url: str, path: Path, *args: str, rate: int = 0) -> list[str]:
    """`hybridrec data replay` of `path` to the test subject at `rate` events/s (0: at once), with `args`."""
    return HYBRIDREC + ["data", "replay", str(path), "--to", f"{url}/{SUBJECT}", "--rate", str(rate), *args]


def _published(url: str) -> list[tuple[int, int, str]]:
    """(first event id, events, format) of every message of the stream, in stream order."""
    from hybridrec.core.layouts.event_stream import FORMAT, events_in, read_format, read_headers

    async def ask():
        import nats

        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            state = (await js.stream_info(STREAM)).state
            out = []
            for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
                msg = await js.get_msg(STREAM, seq)
                first, _ = read_headers(msg.headers)
                out.append((first, events_in(read_format(msg.headers), msg.data or b""),
                            (msg.headers or {}).get(FORMAT, "tsv")))
            return out
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_a_multitask_parquet_file_streams_as_arrow_batches_and_trains_once(tmp_path, multitask_data, broker):
    """`hybridrec data replay FILE.parquet --config` publishes the configured columns as Arrow record batches;
    the MMoE example trains from them as from the file: every event once, every message acknowledged, both
    tasks evaluated. A message without a configured column (published between two good replays) is counted,
    skipped and acknowledged."""
    run = lambda *args: subprocess.run(_replay_args(broker, *args), cwd=REPO, capture_output=True, text=True,  # noqa: E731
                                       timeout=120)
    out = run(multitask_data / "train.parquet", "--config", str(MULTITASK), "--limit", "12000")
    assert out.returncode == 0, out.stderr
    assert "published 12,000 events (0..11999) in 120 messages (Arrow record batches)" in out.stdout, out.stdout
    columns = "click,conversion,d0,d1,d2,d3,user_id,item_id,item_cat,hist_cats"  # no tags: unreadable
    out = run(multitask_data / "train.parquet", "--columns", columns, "--limit", "100", "--first-event", "12000")
    assert out.returncode == 0, out.stderr
    out = run(multitask_data / "eval.parquet", "--config", str(MULTITASK), "--first-event", "12100")
    assert out.returncode == 0 and "published 5,000 events (12100..17099)" in out.stdout, out.stdout
    assert {fmt for _, _, fmt in _published(broker)} == {"arrow"}

    result = _run(_multitask_config(tmp_path, multitask_data, broker, until=17_100), tmp_path / "run")
    assert result["samples"] == 17_000 and result["data"]["train"]["bad_messages"] == 1, result["data"]
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    stream = result["stream"]
    assert stream["events"] == 17_000 and stream["skipped_messages"] == 1 and stream["skipped_events"] == 100, stream
    assert _consumer(broker) == (171, 0, 171)  # the skipped message acknowledged with the rest
    read = _events_read(tmp_path / "run")
    seen = np.zeros(17_100, np.int64)
    for first, n in read:
        seen[first:first + n] += 1
    assert seen[:12_000].min() == seen[12_100:].min() == seen.max() == 1 and seen[12_000:12_100].max() == 0
    assert [t["name"] for t in result["tasks"]] == ["click", "conversion"], result["tasks"]
    assert all(t["auc"] > 0.55 for t in result["tasks"]), result["tasks"]
    skipped = [json.loads(line) for line in (tmp_path / "run" / "logs" / "dataloader-0.log").read_text().splitlines()
               if '"stream_message_skipped"' in line]
    assert len(skipped) == 1 and skipped[0]["seq"] == 121 and skipped[0]["first_event"] == 12_000, skipped
    assert "features.3 (tags).column: no column 'tags'" in skipped[0]["reason"], skipped


def test_a_multitask_stream_trains_every_event_once_across_a_killed_loader(tmp_path, multitask_data, broker):
    """The MMoE example from Arrow messages, its data loader SIGKILLed mid-run: the replacement resumes where the
    ranks are, every event is trained once, and the job's stream account spans both lives of the loader."""
    out = subprocess.run(_replay_args(broker, multitask_data / "train.parquet", "--config", str(MULTITASK)),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "published 20,000 events (0..19999) in 200 messages" in out.stdout, out
    run_dir = tmp_path / "run"
    result = _run(_multitask_config(tmp_path, multitask_data, broker, until=20_000), run_dir, kill="dataloader",
                  at_step=3)
    restarts = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarts[("dataloader", 0)] == 1, restarts
    assert result["samples"] == 20_000 and result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    _assert_each_event_once(run_dir, 20_000)
    stream = result["stream"]
    assert stream["events"] == 20_000 and stream["loader_restarts"] == 1, stream
    assert _consumer(broker) == (200, 0, 200)
    assert [t["name"] for t in result["tasks"]] == ["click", "conversion"], result["tasks"]


def test_an_arrow_message_without_a_configured_column_with_bad_lines_error_stops_the_run_naming_it(
        tmp_path, multitask_data, broker):
    out = subprocess.run(_replay_args(broker, multitask_data / "train.parquet", "--columns",
                                      "click,conversion,d0,d1,d2,d3,user_id,item_id,item_cat,hist_cats", "--limit",
                                      "300"), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config = _multitask_config(tmp_path, multitask_data, broker, until=300, bad_lines="error")
    proc = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(tmp_path / "run")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"subject {SUBJECT}, message 1: features.3 (tags).column: no column 'tags'" in proc.stderr, \
        proc.stderr[-3000:]


def test_replay_refuses_a_file_it_cannot_publish_before_publishing_anything(tmp_path, multitask_data, broker):
    """Binary data that is not Parquet, and a Parquet file without a column the job reads, exit 2 naming the
    file (and the column): nothing is published, the stream is not even created."""
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    for args, message in [
            ((binary,), f"{binary}: neither Criteo TSV lines nor a Parquet file (it holds NUL bytes"),
            ((multitask_data / "eval.parquet", "--config", str(REPO / "examples" / "criteo_synth.yaml")),
             f"{multitask_data / 'eval.parquet'}: no column 'label', which the config reads (data.labels (label))"),
            ((multitask_data / "eval.parquet", "--columns", "click,clicks"),
             f"{multitask_data / 'eval.parquet'}: no column 'clicks' (--columns)"),
            ((multitask_data / "oracle.json",), f"{multitask_data / 'oracle.json'}: neither Criteo TSV lines")]:
        out = subprocess.run(_replay_args(broker, *args), cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)

    async def streams():
        import nats

        nc = await nats.connect(broker)
        try:
            return await nc.jetstream().streams_info()
        finally:
            await nc.close()

    assert not asyncio.run(streams())


def test_a_replay_goes_on_across_a_broker_restart_and_stores_every_event_once_in_order(tmp_path, multitask_data,
                                                                                       nats_server):
    """The broker SIGKILLed in the middle of a replay and started again with its store: the replay sends what
    was in flight again over a new connection, and the broker, which had stored some of it, keeps one copy
    (Nats-Msg-Id): every event once, in order."""
    asyncio.run(_create(nats_server.url))
    replaying = subprocess.Popen(HYBRIDREC + ["data", "replay", str(multitask_data / "train.parquet"), "--to",
                                              f"{nats_server.url}/{SUBJECT}", "--rate", "4000",
                                              "--rows-per-message", "50"], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(_published(nats_server.url)) < 60:  # about 0.75 s of it stored
        assert replaying.poll() is None and time.monotonic() < deadline, replaying.communicate()
        time.sleep(0.05)
    nats_server.kill()
    time.sleep(1.5)
    assert replaying.poll() is None, "the replay ended while the broker was down"
    nats_server.start()
    out, err = replaying.communicate(timeout=120)
    assert replaying.returncode == 0, err
    assert "published 20,000 events (0..19999) in 400 messages" in out, out
    # At least the one outage (a broker still starting can answer 503 and cost another reconnection)
    assert int(re.search(r"(\d+) reconnections?", out)[1]) >= 1, out
    messages = _published(nats_server.url)
    assert [first for first, _, _ in messages] == list(range(0, 20_000, 50)), messages[:5]
    assert all(n == 50 for _, n, _ in messages)


async def _create(url: str) -> None:
    from hybridrec.app.run.broker import create_stream
    from hybridrec.core.config import StreamConfig

    await create_stream(url, StreamConfig())
