"""docker-compose.yml trains the synthetic example to completion, with each installed Compose, and serves it.

Both installed Composes, Compose v2 (`docker compose`) and Debian's
docker-compose 1.29, accept the file with and without its profiles; each
then runs one of its two training paths end to end (a whole cluster run is
about a minute of both cores, so each path runs once, not once per Compose):

* v2 runs deploy/compose/train.sh (`up --exit-code-from nn-worker-0
  nn-worker-0`, then the summary, then cleanup) on a small synthetic set and
  goes on with the same run's checkpoints: `--profile serve up -d inference`
  exports the final checkpoint and serves it, and raw Criteo rows POSTed to
  /v2/models/hybridrec/infer get probabilities;
* 1.29 runs the profile `online`: nats, the replay of the synthetic file,
  training on the stream (every event once) and inference-online answering
  from a published version.

Each run has its own project name and removes its containers and volumes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest
import yaml

from hybridrec.app.run.ports import free_port
from tests.containers.cluster import REPO
from tests.containers.conftest import AUC_THRESHOLD, IMAGE, SYNTH_ROWS

COMPOSE_TIMEOUT_S = 900
SERVE_TIMEOUT_S = 240
ONLINE_ROWS = int(os.environ.get("HYBRIDREC_TEST_ONLINE_ROWS", "30000"))
"""Rows the online profile's test replays and trains (a multiple of the replay's 100 rows a message)."""
ONLINE = {"nats", "replay", "inference-online"}
SERVE = {"export", "inference"}
TRAINING = {"ps-0", "ps-1", "embedding-worker-0", "dataloader-0", "dataloader-1", "nn-worker-0", "nn-worker-1"}
LOADERS = 2
"""The data loaders docker-compose.yml runs (cluster.dataloader of deploy/compose/config.yaml and online.yaml)."""
ROWS = [  # raw Criteo rows (13 integer, 26 categorical columns, no label), as in docs/serving.md
    "1\t2\t\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t68fd1e64\t80e26c9b\tfb936136\t7b4723c4\t25c83c98\t7e0ccccf\t"
    "de7995b8\t1f89b562\ta73ee510\ta8cd5504\tb2cb9c98\t37c9c164\t2824a5f6\t1adce6ef\t8ba8b39a\t891b62e7\te5ba7672\t"
    "f54016b9\t21ddcdc9\tb1252a9d\t07b5194c\t\t3a171ecb\tc5c50484\te8b83407\t9727dd16",
    "\t3\t1" + "\t" * 10 + "\t05db9164" + "\t" * 25,
]


def available() -> dict[str, list[str]]:
    found = {}
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        found["v2"] = ["docker", "compose"]
    if shutil.which("docker-compose"):
        found["v1"] = ["docker-compose"]
    return found


def wait_healthy(container, timeout_s: int = 60) -> str | None:
    """The container's health status once healthy, or the last one seen after `timeout_s` seconds."""
    health = None
    for _ in range(timeout_s):
        container.reload()
        health = container.attrs["State"].get("Health", {}).get("Status")
        if health == "healthy":
            break
        time.sleep(1)
    return health


def compose_command(flavor: str) -> list[str]:
    """The command of Compose `flavor`; fails when no Compose is installed at all (.ci/run installs both)."""
    flavors = available()
    if not flavors:
        pytest.fail("neither `docker compose` (v2) nor `docker-compose` (1.29) is installed; "
                    "`sudo bash .ci/compose.sh` installs both", pytrace=False)
    if flavor not in flavors:
        pytest.skip(f"Compose {flavor} is not installed (ran with {', '.join(flavors)})")
    return flavors[flavor]


@pytest.mark.parametrize("flavor", ["v2", "v1"])
def test_compose_accepts_the_file_with_and_without_its_profiles(flavor):
    flavors = available()
    if flavor not in flavors:
        pytest.skip(f"Compose {flavor} is not installed")
    for profile, added in (([], set()), (["--profile", "serve"], SERVE), (["--profile", "online"], ONLINE)):
        proc = subprocess.run([*flavors[flavor], *profile, "config", "--services"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        services = set(proc.stdout.split())
        assert {"nn-worker-0", "ps-0", "synth"} <= services, proc.stdout
        assert added <= services, proc.stdout
        if flavor == "v2":  # 1.29's `config --services` lists every service, profile or not
            assert not (SERVE | ONLINE) - added & services, proc.stdout
    # HYBRIDREC_CONFIG picks the job config every training container mounts; unset, config.yaml
    for chosen, expected in ((None, "deploy/compose/config.yaml"),
                             ("./deploy/compose/online.yaml", "deploy/compose/online.yaml")):
        env = {k: v for k, v in os.environ.items() if k != "HYBRIDREC_CONFIG"}
        if chosen:
            env["HYBRIDREC_CONFIG"] = chosen
        proc = subprocess.run([*flavors[flavor], "--profile", "online", "config"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        sources = {name: config_source(service) for name, service in yaml.safe_load(proc.stdout)["services"].items()}
        assert {name for name, source in sources.items() if source} == TRAINING | {"nats"}, sources
        assert {source for source in sources.values() if source} == {str(REPO / expected)}, (chosen, sources)


def config_source(service: dict) -> str | None:
    """The host file a resolved service (`config` output) mounts at /etc/hybridrec/config.yaml: v2 writes long
    syntax, 1.29 "source:target:mode"."""
    for volume in service.get("volumes", []):
        if isinstance(volume, dict) and volume.get("target") == "/etc/hybridrec/config.yaml":
            return volume["source"]
        if isinstance(volume, str) and volume.split(":")[1:2] == ["/etc/hybridrec/config.yaml"]:
            return volume.split(":")[0]
    return None




def http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            content = response.read()  # Triton answers /v2/health/ready with an empty body
            return response.status, json.loads(content) if content else {}
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def serve_and_predict(compose, project, env, docker_client, engine: str = "builtin") -> str:
    """`--profile serve up -d inference` on the trained project's volumes with `engine` (HYBRIDREC_ENGINE); a
    prediction over REST. Triton's layout puts the batch dimension first everywhere (`rows` [n, 1], answers
    [n, 1]) and numbers an export version 1 (Triton's versions start at 1)."""
    http_port = free_port()
    env = {**env, "HYBRIDREC_HTTP_PORT": str(http_port), "HYBRIDREC_GRPC_PORT": str(free_port()),
           "HYBRIDREC_ENGINE": engine}
    serve = [*compose, "-p", project, "--profile", "serve"]
    started = time.monotonic()
    proc = subprocess.run([*serve, "up", "-d", "inference"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SERVE_TIMEOUT_S)
    logs = lambda: subprocess.run([*serve, "logs", "--no-color", "export", "inference"], cwd=REPO, env=env,  # noqa: E731
                                  capture_output=True, text=True, timeout=60).stdout[-6000:]
    assert proc.returncode == 0, f"up inference failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs()}"
    base = f"http://127.0.0.1:{http_port}"
    status, ready = None, {}
    while time.monotonic() - started < SERVE_TIMEOUT_S:
        try:
            status, ready = http(f"{base}/v2/health/ready", timeout=5)
        except OSError:  # not listening yet
            status = None
        if status == 200:
            break
        time.sleep(1)
    assert status == 200, f"{engine}: not ready: {status} {ready}\n{logs()}"
    ready_s = time.monotonic() - started
    triton = engine == "triton"
    shape, version = ([len(ROWS), 1], "1") if triton else ([len(ROWS)], "0")  # an export is version 0
    status, answer = http(f"{base}/v2/models/hybridrec/infer",
                          {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": shape, "data": ROWS}]})
    assert status == 200, f"{engine}: {status} {answer}\n{logs()}"
    assert answer["model_name"] == "hybridrec" and answer["model_version"] == version, answer
    [output] = answer["outputs"]
    assert output["name"] == "probability" and output["shape"] == shape, answer
    assert all(0.0 < p < 1.0 for p in output["data"]), answer
    status, metadata = http(f"{base}/v2/models/hybridrec")
    assert status == 200 and metadata["versions"] == [version], metadata
    # The compose healthcheck (/v2/health/ready) turns healthy too.
    [container] = docker_client.containers.list(filters={"label": [f"com.docker.compose.project={project}",
                                                                    "com.docker.compose.service=inference"]})
    health = wait_healthy(container)
    assert health == "healthy", f"{engine}: inference container health {health}\n{logs()}"
    return f"served by {engine}: ready {ready_s:.0f}s after `up` (export included), probabilities {output['data']}"


@pytest.mark.parametrize("flavor", ["v2"])  # the file profile with Compose v2; the online one with 1.29 (below)
def test_compose_trains_the_synthetic_example(flavor, docker_client, image, tmp_path):
    compose = compose_command(flavor)
    project = f"hybridrec-test-{uuid.uuid4().hex[:8]}"
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "COMPOSE_PROJECT_NAME": project, "COMPOSE": " ".join(compose),
           "HYBRIDREC_IMAGE": image, "HYBRIDREC_SYNTH_ROWS": str(SYNTH_ROWS), "SUMMARY_OUT": str(summary_path)}
    try:
        proc = subprocess.run(["bash", str(REPO / "deploy" / "compose" / "train.sh")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=COMPOSE_TIMEOUT_S)
        output = f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        assert proc.returncode == 0, f"{' '.join(compose)} run failed ({proc.returncode}):\n{output}"
        summary = json.loads(summary_path.read_text())
        assert summary["samples"] == SYNTH_ROWS, output
        shares = [loader["rows"] for loader in summary["data"]["train"]["loaders"]]  # each loader read its share
        assert len(shares) == LOADERS and sum(shares) == SYNTH_ROWS and min(shares) > 0, summary["data"]
        assert summary["auc"] >= AUC_THRESHOLD, f"AUC {summary['auc']:.4f} < {AUC_THRESHOLD}\n{output}"
        assert summary["oracle_auc"] is not None, f"no oracle_auc although synth wrote oracle.json\n{output}"
        wall = [line for line in proc.stderr.splitlines() if "compose run took" in line]
        print(f"compose {flavor}: AUC {summary['auc']:.4f}; {wall[-1] if wall else ''}")
        for engine in ("builtin", "triton"):  # ~20 s each more than training alone
            served = serve_and_predict(compose, project, env, docker_client, engine)
            print(f"compose {flavor}: {served}")
    finally:
        subprocess.run([*compose, "-p", project, "--profile", "serve", "down", "--volumes", "--remove-orphans"],
                       cwd=REPO, env=env, capture_output=True, timeout=300)
    leftovers = docker_client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
    assert not leftovers, f"containers left behind: {[c.name for c in leftovers]}"
    volumes = docker_client.volumes.list(filters={"label": f"com.docker.compose.project={project}"})
    assert not volumes, f"volumes left behind: {[v.name for v in volumes]}"


# --- profile "online" --------------------------------------------------------------------------------------------

_CONSUMER_SCRIPT = """
import asyncio, json, nats
async def main():
    nc = await nats.connect("nats://127.0.0.1:4222", connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        stream = await js.stream_info("HYBRIDREC_EVENTS")
        consumers = [await js.consumer_info("HYBRIDREC_EVENTS", f"hybridrec-trainer-{l}") for l in range(LOADERS)]
        print(json.dumps({"messages": stream.state.messages, "last_seq": stream.state.last_seq,
                          "ack_floor": [c.ack_floor.stream_seq for c in consumers],
                          "ack_pending": [c.num_ack_pending for c in consumers]}))
    finally:
        await nc.close()
asyncio.run(main())
"""


def container_of(docker_client, project: str, service: str):
    [container] = docker_client.containers.list(all=True, filters={"label": [f"com.docker.compose.project={project}",
                                                                             f"com.docker.compose.service={service}"]})
    return container


def read_file(container, path: str) -> str:
    import io
    import tarfile

    stream, _ = container.get_archive(path)
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        return tar.extractfile(tar.getmembers()[0]).read().decode()


@pytest.mark.parametrize("flavor", ["v1"])  # the online profile with 1.29; the file one with v2 (above)
def test_compose_online_profile_trains_a_replayed_stream_once_and_serves_its_versions(flavor, docker_client, image,
                                                                                     tmp_path):
    """The documented commands of the profile `online`, with HYBRIDREC_CONFIG naming deploy/compose/online.yaml
    (until_event set to this test's rows): `up -d replay inference-online` (synth, a healthy nats holding the stream,
    the replay), then at once `up --exit-code-from nn-worker-0 nn-worker-0` trains the stream, as the replay fills
    it, to its end. Every replayed
    event is trained once (summary samples, each loader's stream-<l>.json, the broker's consumers: all acknowledged,
    none pending), versions are published, and inference-online serves the last one to raw rows over REST."""
    compose = compose_command(flavor)
    assert ONLINE_ROWS % 100 == 0, "the replay sends 100 rows a message"
    job = yaml.safe_load((REPO / "deploy" / "compose" / "online.yaml").read_text())
    job["data"]["stream"]["until_event"] = ONLINE_ROWS  # the end of the replayed file
    config = tmp_path / "online.yaml"
    config.write_text(yaml.safe_dump(job, sort_keys=False))
    project = f"hybridrec-online-{uuid.uuid4().hex[:8]}"
    http_port = free_port()
    env = {**os.environ, "COMPOSE_PROJECT_NAME": project, "HYBRIDREC_IMAGE": image, "HYBRIDREC_CONFIG": str(config),
           "HYBRIDREC_SYNTH_ROWS": str(ONLINE_ROWS), "HYBRIDREC_REPLAY_RATE": "1000",
           "HYBRIDREC_HTTP_PORT": str(http_port), "HYBRIDREC_GRPC_PORT": str(free_port())}
    online = [*compose, "-p", project, "--profile", "online"]

    def logs(*services: str) -> str:
        return subprocess.run([*online, "logs", "--no-color", *services], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60).stdout[-6000:]

    started = time.monotonic()
    try:
        proc = subprocess.run([*online, "up", "-d", "replay", "inference-online"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=SERVE_TIMEOUT_S)
        assert proc.returncode == 0, f"up replay failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs()}"
        up_s = time.monotonic() - started
        # Training starts while the replay publishes (30 s at 1,000 events a second): the loader reads the
        # stream as it fills and ends with the last replayed event.
        proc = subprocess.run([*online, "up", "--exit-code-from", "nn-worker-0", "nn-worker-0"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=COMPOSE_TIMEOUT_S)
        output = f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, \
            f"online training failed ({proc.returncode}):\n{output}\n{logs('dataloader-0', 'dataloader-1')}"
        trained_s = time.monotonic() - started - up_s
        replay = container_of(docker_client, project, "replay")
        assert replay.wait(timeout=60)["StatusCode"] == 0, logs("replay", "nats")
        published = replay.logs().decode()
        messages = ONLINE_ROWS // 100
        assert f"published {ONLINE_ROWS:,} events (0..{ONLINE_ROWS - 1}) in {messages} messages" in published, published
        rank0 = container_of(docker_client, project, "nn-worker-0")
        summary = json.loads(read_file(rank0, "/results/summary.json"))
        # each data loader's account of its partition, on the same volume
        accounts = [json.loads(read_file(rank0, f"/results/stream-{loader}.json")) for loader in range(LOADERS)]

        # every replayed event trained exactly once, nothing skipped or lost
        assert summary["samples"] == ONLINE_ROWS and summary["data"]["train"]["rows"] == ONLINE_ROWS, summary["data"]
        assert summary["skipped_batches"] == 0 and summary["lost_updates"] == 0, summary
        # message m (stream seq m + 1) went to partition m mod 2, then an end marker to each (seqs messages + 1
        # and + 2). Partition 1 holds the last event: it ends at its last message (seq messages); partition 0 ends
        # at its marker (seq messages + 1), which it acknowledges with the rest once all is trained
        ends = [messages + 1, messages]
        assert sum(account["events"] for account in accounts) == ONLINE_ROWS, accounts
        for loader, account in enumerate(accounts):
            assert account["events"] == ONLINE_ROWS // LOADERS and account["first_seq"] == 1, account
            assert account["acknowledged_through"] == ends[loader], account
        assert summary["auc"] > 0.6 and summary["oracle_auc"] is not None, summary  # eval file, after the stream
        code, out = container_of(docker_client, project, "nats").exec_run(
            ["python", "-c", f"LOADERS = {LOADERS}\n{_CONSUMER_SCRIPT}"])
        assert code == 0, out.decode()
        broker = json.loads(out.decode().strip().splitlines()[-1])
        # partition 1's marker may have been fetched with its last message and is then left unacknowledged (the
        # partition had ended): a next job's consumer starts after the floor and passes over a marker before data
        pending = broker.pop("ack_pending")
        assert broker == {"messages": messages + LOADERS, "last_seq": messages + LOADERS, "ack_floor": ends}, broker
        assert pending[0] == 0 and pending[1] in (0, 1), pending
        # versions published into the volume inference-online follows
        publish = summary["publish"]
        assert publish and publish["published"] >= 1 and publish["failed"] == 0, publish
        assert publish["directory"] == job["publish"]["dir"], publish
        last = str(publish["last_version"])

        # inference-online follows them: it serves the last version (swapped in within a poll) to raw rows
        base = f"http://127.0.0.1:{http_port}"
        deadline, status, metadata = time.monotonic() + SERVE_TIMEOUT_S, None, {}
        while time.monotonic() < deadline:
            try:
                status, metadata = http(f"{base}/v2/models/hybridrec", timeout=5)
            except OSError:  # not listening yet
                status = None
            if status == 200 and metadata.get("versions") == [last]:
                break
            time.sleep(1)
        assert status == 200 and metadata["versions"] == [last], \
            f"inference-online does not serve version {last}: {status} {metadata}\n{logs('inference-online')}"
        status, ready = http(f"{base}/v2/health/ready")
        assert status == 200 and ready == {"ready": True}, ready
        status, answer = http(f"{base}/v2/models/hybridrec/infer",
                              {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(ROWS)], "data": ROWS}]})
        assert status == 200, f"{status} {answer}\n{logs('inference-online')}"
        assert answer["model_name"] == "hybridrec" and answer["model_version"] == last, answer
        [output] = answer["outputs"]
        assert output["name"] == "probability" and output["shape"] == [len(ROWS)], answer
        assert all(0.0 < p < 1.0 for p in output["data"]), answer
        follower = container_of(docker_client, project, "inference-online")
        health = wait_healthy(follower)  # its healthcheck (REST readiness) turns healthy too
        assert health == "healthy", f"inference-online health {health}\n{logs('inference-online')}"
        lag = accounts[0]["training_lag_s"]
        print(f"compose {flavor} online: `up -d replay inference-online` {up_s:.0f}s, {ONLINE_ROWS:,} events "
              f"trained once in {trained_s:.0f}s (start-up included; lag p50 {lag['p50']:.1f}s, max {lag['max']:.1f}s), "
              f"AUC {summary['auc']:.4f}, {publish['published']} versions, version {last} served: {output['data']}")
    finally:
        subprocess.run([*online, "down", "--volumes", "--remove-orphans"], cwd=REPO, env=env, capture_output=True,
                       timeout=300)
    leftovers = docker_client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
    assert not leftovers, f"containers left behind: {[c.name for c in leftovers]}"
    volumes = docker_client.volumes.list(filters={"label": f"com.docker.compose.project={project}"})
    assert not volumes, f"volumes left behind: {[v.name for v in volumes]}"
