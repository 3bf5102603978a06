"""Live versions end to end: `hybridrec run` with publish.interval_steps=10 writes versions whose merged table
equals the PS at the end of training (the final job checkpoint, taken after every rank drained its updates), and whose last dense weights are the trained model's; a FollowSource following such a run stays
fresh, and 8 clients reading through its swaps get predictions of exactly the version they name."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.core.wire.ids import GROUP_SHIFT
from hybridrec.app.run.ports import free_port
from hybridrec.core.layouts.versions import Follower, list_versions, load_version, newest_version_number, table_arrays
from services.inference.follow import FollowSource, _default_make_model
from services.inference.model import build_dense
from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration

STEPS = 50


def _checkpoint_rows(step_dir, dim):
    """Every row of width `dim` a checkpoint holds (its chain followed), sorted by key."""
    from services.embedding_ps.checkpoint import read_embeddings

    _, tables = read_embeddings(step_dir)
    keys = np.concatenate([np.asarray(k) for _, d, k, _ in tables if d == dim])
    rows = np.concatenate([np.asarray(r) for _, d, _, r in tables if d == dim])
    order = np.argsort(keys)
    return keys[order], rows[order]


def test_published_versions_merge_to_the_final_ps_state(tmp_path, small_data):
    config = write_config(tmp_path / "config.yaml", small_data,
                          training={"batch_size": 512, "max_steps": STEPS},
                          ps={"capacity": 1_000_000},
                          publish={"interval_steps": 10, "full_every": 3, "keep": 2})
    run_dir = tmp_path / "run"
    result = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    publish = summary["publish"]
    assert publish["failed"] == 0 and publish["published"] + publish["skipped"] >= STEPS // 10, publish
    # A version is skipped only where the one before took longer than 10 steps to write (a loaded machine)
    assert publish["published"] >= (4 if publish["skipped"] == 0 else 2), publish
    assert publish["last_step"] == STEPS and publish["full"] >= min(2, (publish["published"] + 2) // 3), publish

    versions, other = list_versions(run_dir / "versions")
    assert not other, other
    numbers = [v.version for v in versions]
    assert numbers[-1] == publish["last_version"]
    # compaction kept the newest full snapshot, the deltas after it and the 2 newest, with their chains
    fulls = [v.version for v in versions if v.full]
    assert fulls and all(n >= fulls[0] for n in numbers)
    assert all(v.manifest.base_version in numbers for v in versions if not v.full)

    snapshot = Follower(run_dir / "versions").poll()
    assert snapshot.version == numbers[-1] and snapshot.step == STEPS
    step_dir = Path(summary["checkpoint"])  # the final checkpoint: every rank's updates applied
    for dim in snapshot.manifest.widths:
        keys, rows = table_arrays(snapshot.table, dim)
        want_keys, want_rows = _checkpoint_rows(step_dir, dim)
        np.testing.assert_array_equal(keys, want_keys)
        np.testing.assert_array_equal(rows, want_rows)
    trained = torch.load(run_dir / "dense_model.pt", weights_only=True)
    assert trained.keys() == snapshot.dense_state.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, snapshot.dense_state[name]), name


def predict(model, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """A forward pass as an inference service makes it: one ID per feature (sum pooling of one row)."""
    embeddings = {f.name: torch.from_numpy(model.table.lookup(f.dim, ids[:, i]))
                  for i, f in enumerate(model.manifest.features)}
    with torch.no_grad():
        return torch.sigmoid(model.dense(torch.from_numpy(dense), embeddings).reshape(-1)).numpy()


def _start_publishing_run(tmp_path, small_data, epochs: int = 4):
    """A `hybridrec run` publishing a version every 10 steps; returns (process, run dir, versions dir)."""
    config = write_config(tmp_path / "config.yaml", small_data,
                          # 117 steps of 1,024 rows: 11 versions, one every ~0.8 s (batch 512 published one every
                          # 0.4 s on a loaded 2-core machine: faster than a loaded follower could be asked to keep up)
                          training={"batch_size": 1024, "epochs": epochs},
                          publish={"interval_steps": 10, "full_every": 4, "keep": 1000})
    run_dir = tmp_path / "run"
    run = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return run, run_dir, run_dir / "versions"


def test_a_follower_answers_with_the_version_it_names(tmp_path, small_data):
    """FollowSource in this process, with 8 client threads reading through its swaps: no errors, at least 5
    swaps, the last version served, and every answer equal to a forward pass of the version it names.
    Freshness (2 versions, 10 s) is the service's promise and is measured on the service below: here the 8
    client threads share this process's GIL with the follower, and on a loaded 2-core machine they starve it
    (docs/serving.md#following-versions)."""
    run, run_dir, root = _start_publishing_run(tmp_path, small_data, epochs=8)  # ~23 versions: a loaded follower
    source = FollowSource(root, poll_s=0.2)                                    # that misses some still swaps 5
    stop = threading.Event()
    responses: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    errors: list[str] = []

    def client(seed: int) -> None:
        r = np.random.default_rng(seed)
        known: dict[int, np.ndarray] = {}  # each version's IDs, gathered once: the clients load the process as
        while not stop.is_set():           # request handlers would, not with a table scan per request
            try:
                model = source.current()  # once per micro-batch
                if model.version not in known:
                    known[model.version] = table_arrays(model.table, model.manifest.widths[0])[0]
                keys = known[model.version]
                ids = r.choice(keys, size=(32, len(model.manifest.features)))
                ids[:, 0] = r.integers(1, 1 << 40, 32).astype(np.uint64)  # and one unknown ID per sample
                dense = r.standard_normal((32, model.manifest.num_dense)).astype(np.float32)
                responses.append((model.version, dense, ids, predict(model, dense, ids)))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.02)

    try:
        deadline = time.monotonic() + 240
        while not list_versions(root)[0] and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        source.start(wait_s=30)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        _, stderr = run.communicate(timeout=600)
        newest, deadline = newest_version_number(root), time.monotonic() + 30
        while source.stats()["served_version"] < newest and time.monotonic() < deadline:
            time.sleep(0.1)  # let the follower take the final version
    finally:
        stop.set()
        if run.poll() is None:
            run.kill()
        source.stop()
    for t in threads:
        t.join()
    assert run.returncode == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not errors, errors[:5]
    assert source.swaps >= 5 and source.stats()["served_version"] == summary["publish"]["last_version"]
    served = sorted({v for v, *_ in responses})
    assert len(served) >= 5, served
    print(f"follower: {source.swaps} swaps, {len(responses)} responses over versions {served}; "
          f"publish {summary['publish']}")
    reference: dict[int, object] = {}
    for version, dense, ids, preds in responses[::max(1, len(responses) // 400)]:
        if version not in reference:
            snapshot = load_version(root, version)
            reference[version] = _default_make_model(snapshot, build_dense(snapshot.manifest, snapshot.dense_state))
        np.testing.assert_allclose(predict(reference[version], dense, ids), preds, rtol=0, atol=1e-5)


_free_port = free_port  # below the ephemeral range: no outgoing connection can take it first


def test_the_inference_service_follows_a_training_run(tmp_path, small_data):
    """`hybridrec serve inference --follow` during a run publishing every 10 steps: within 2 versions (or 2 s) and
    10 s of the newest; 8 gRPC clients through at least 5 swaps see no errors, and every response's probabilities equal
    (1e-5) a forward pass, outside the service, of the version the response names."""
    import grpc
    import http.client
    import re
    import urllib.request

    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    root = tmp_path / "run" / "versions"  # where _start_publishing_run's run publishes
    grpc_port, http_port = _free_port(), _free_port()
    # The service starts first and waits for a first version, so a slow start on a loaded machine cannot let
    # the run publish most of its versions before anyone follows.
    server = subprocess.Popen(HYBRIDREC + ["serve", "inference", "--follow", str(root), "--set", "model_name=ctr",
                                           "--set", f"grpc_port={grpc_port}", "--set", f"http_port={http_port}",
                                           "--set", "follow_poll_s=0.2"],
                              cwd=REPO, stdout=open(tmp_path / "inference.log", "w"), stderr=subprocess.STDOUT)
    # And the run starts once the service has loaded what a first version's load would otherwise wait for (numba,
    # the exporter: seconds on a loaded machine, in which a fast run published most of its versions).
    deadline = time.monotonic() + 240
    while '"follow_warmed"' not in (tmp_path / "inference.log").read_text():
        assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "inference.log").read_text()[-3000:]
        time.sleep(0.1)
    run, run_dir, _ = _start_publishing_run(tmp_path, small_data, epochs=16)  # ~47 versions: a fast run on a
    # loaded machine still publishes many after the service is ready and the clients have started
    stop = threading.Event()
    responses: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    errors: list[str] = []
    stacks_asked = threading.Event()
    answered = [time.monotonic()]  # when a client was last answered
    lag: list[tuple[int, float]] = []
    threads: list[threading.Thread] = []

    def served_version() -> int:
        # A scrape can go unanswered for 10 s when the machine is loaded (a clean-clone CI saw one time out while
        # a version loaded): ask again rather than lose the monitor, which would see no swap at all.
        for attempt in range(6):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
                    text = r.read().decode()
                break
            except (OSError, http.client.HTTPException):
                if attempt == 5:
                    raise
                time.sleep(0.2)
        return int(float(re.search(r"^hybridrec_inference_served_version\{[^}]*\} (\S+)$", text, re.M)[1]))

    def client(seed: int, pools: list[np.ndarray]) -> None:
        r = np.random.default_rng(seed)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=oip.ModelInferResponse.FromString)
            while not stop.is_set():
                ids = np.stack([r.choice(pool, size=16) for pool in pools], axis=1)  # each feature's own group
                dense = r.standard_normal((16, 13)).astype(np.float32)
                request = oip.ModelInferRequest(model_name="ctr")
                for name, array, dtype in (("ids", ids, "UINT64"), ("dense", dense, "FP32")):
                    request.inputs.add(name=name, datatype=dtype, shape=list(array.shape))
                    request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
                try:
                    response = infer(request, timeout=30)
                    probs = np.frombuffer(response.raw_output_contents[0], np.float32)
                    responses.append((int(response.model_version), ids, dense, probs))
                    answered[0] = time.monotonic()
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code()}: {exc.details()}")
                time.sleep(0.02)

    def watchdog() -> None:
        # No answer for 5 s while 8 clients ask every 20 ms: every thread's stack, into the service's log, while
        # it waits (a clean-clone CI saw the answers stop for 19 s while the service swapped 45 versions).
        while not stop.wait(0.5):
            if time.monotonic() - answered[0] > 5 and not stacks_asked.is_set():
                stacks_asked.set()
                server.send_signal(signal.SIGUSR2)

    def monitor(cold: int) -> None:
        # From the service's first swap after the cold first load that made it ready (`cold`: the version it
        # served when it became ready): versions published during that load (3 to 7 of them once a run's start-up
        # got faster than the service's, 4.5 s on a loaded machine) are the cold load's lag, which `loads` below
        # leaves out as well, not the follower's.
        while not stop.is_set() and served_version() == cold:
            time.sleep(0.05)
        while not stop.is_set():
            # List first, then ask: a version published between the two must not count as one the service
            # had already failed to load when it answered.
            published = list_versions(root)[0]
            served = served_version()
            newer = [v for v in published if v.version > served]
            lag.append((len(newer), time.time() - min(v.manifest.created for v in newer) if newer else 0.0))
            time.sleep(0.1)

    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "inference.log").read_text()[-3000:]
            assert time.monotonic() < deadline, ("the inference service was not ready within 240 s; run: "
                                                 f"{run.poll()}, versions: {list_versions(root)[0]}\n"
                                                 + (tmp_path / "inference.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        ready_version = served_version()
        first = load_version(root, ready_version)
        keys = table_arrays(first.table, first.manifest.widths[0])[0]
        pools = [keys[(keys >> np.uint64(GROUP_SHIFT)) == f.group] for f in first.manifest.features]
        threads = [threading.Thread(target=client, args=(i, pools)) for i in range(8)]
        threads.append(threading.Thread(target=monitor, args=(ready_version,)))
        answered[0] = time.monotonic()
        threads.append(threading.Thread(target=watchdog))
        for t in threads:
            t.start()
        _, stderr = run.communicate(timeout=600)
        if run.returncode == 0:  # until a client was answered by the final version (a loaded machine loads slowly)
            last = json.loads((run_dir / "summary.json").read_text())["publish"]["last_version"]
            deadline = time.monotonic() + 60
            while not any(v == last for v, *_ in responses[-200:]) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for proc in (run, server):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
    assert run.returncode == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not errors, (errors[:5], (tmp_path / "inference.log").read_text()[-12000:])
    served = sorted({v for v, *_ in responses})
    assert lag, "the service never swapped a version after its first"
    worst_behind, worst_age = max(b for b, _ in lag), max(a for _, a in lag)
    print(f"inference --follow: {len(responses)} responses over versions {served}; worst lag {worst_behind} "
          f"versions / {worst_age:.2f} s; publish {summary['publish']}")
    assert len(served) >= 6 and served[-1] == summary["publish"]["last_version"], (  # >= 5 swaps
        served, (tmp_path / "inference.log").read_text()[-12000:] if stacks_asked.is_set() else "")
    # Within 2 versions of the newest, or behind versions published under 2 s ago, never 10 s behind: on an idle
    # machine. On a loaded one the run publishes several while one loads (a clean-clone CI beside other work saw 3
    # behind at 1.7 s; two suites at once 15 behind at 8.9 s), so the bound grows with the service's own loads:
    # a version published as a load began waits for that load and the next (the follower polls again at once).
    loads = [json.loads(line)["load_s"] for line in (tmp_path / "inference.log").read_text().splitlines()
             if '"version_swapped"' in line][1:]  # after the first (cold, before the service was ready)
    bound = max(2.0, 2 * max(loads, default=0.0) + 1.0)
    assert all(behind <= 2 or age <= bound for behind, age in lag), (worst_behind, worst_age, bound)
    assert worst_age <= max(10.0, bound), (worst_behind, worst_age, bound)
    reference: dict[int, object] = {}
    for version, ids, dense, probs in responses[::max(1, len(responses) // 300)]:
        if version not in reference:
            snapshot = load_version(root, version)
            reference[version] = _default_make_model(snapshot, build_dense(snapshot.manifest, snapshot.dense_state))
        np.testing.assert_allclose(probs, predict(reference[version], dense, ids), rtol=0, atol=1e-5)
