"""docker-compose.yml trains the synthetic example to completion, with each installed Compose, and serves it.

Runs deploy/compose/train.sh (`up --exit-code-from nn-worker-0 nn-worker-0`,
then the summary, then cleanup) on a small synthetic set, once with Compose
v2 (`docker compose`) and once with Debian's docker-compose 1.29, whichever
are installed; at least one must be. Each then goes on with the same run's
checkpoints: `--profile serve up -d inference` exports the final checkpoint
and serves it, and raw Criteo rows POSTed to /v2/models/hybridrec/infer get
probabilities. Each run has its own project name and removes its containers
and volumes.
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

from hybridrec.app.launcher import free_port
from tests.containers.cluster import REPO
from tests.containers.conftest import AUC_THRESHOLD, IMAGE, SYNTH_ROWS

COMPOSE_TIMEOUT_S = 900
SERVE_TIMEOUT_S = 240
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


@pytest.mark.parametrize("flavor", ["v2", "v1"])
def test_compose_accepts_the_file_with_and_without_the_serve_profile(flavor):
    flavors = available()
    if flavor not in flavors:
        pytest.skip(f"Compose {flavor} is not installed")
    for profile in ([], ["--profile", "serve"]):
        proc = subprocess.run([*flavors[flavor], *profile, "config", "--services"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        services = set(proc.stdout.split())
        assert {"nn-worker-0", "ps-0", "synth"} <= services, proc.stdout
        if profile:
            assert {"export", "inference"} <= services, proc.stdout
        elif flavor == "v2":  # 1.29's `config --services` lists every service, profile or not
            assert not {"export", "inference"} & services, proc.stdout




def http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def serve_and_predict(compose, project, env, docker_client) -> str:
    """`--profile serve up -d inference` on the trained project's volumes; a prediction over REST."""
    http_port = free_port()
    env = {**env, "HYBRIDREC_HTTP_PORT": str(http_port), "HYBRIDREC_GRPC_PORT": str(free_port())}
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
    assert status == 200 and ready == {"ready": True}, f"not ready: {status} {ready}\n{logs()}"
    ready_s = time.monotonic() - started
    status, answer = http(f"{base}/v2/models/hybridrec/infer",
                          {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(ROWS)], "data": ROWS}]})
    assert status == 200, f"{status} {answer}\n{logs()}"
    assert answer["model_name"] == "hybridrec" and answer["model_version"] == "0", answer  # an export is version 0
    [output] = answer["outputs"]
    assert output["name"] == "probability" and output["shape"] == [len(ROWS)], answer
    assert all(0.0 < p < 1.0 for p in output["data"]), answer
    status, metadata = http(f"{base}/v2/models/hybridrec")
    assert status == 200 and metadata["versions"] == ["0"], metadata
    # The compose healthcheck (grpc.health.v1 on the gRPC port) turns healthy too.
    [container] = docker_client.containers.list(filters={"label": [f"com.docker.compose.project={project}",
                                                                    "com.docker.compose.service=inference"]})
    health = None
    for _ in range(60):
        container.reload()
        health = container.attrs["State"].get("Health", {}).get("Status")
        if health == "healthy":
            break
        time.sleep(1)
    assert health == "healthy", f"inference container health {health}\n{logs()}"
    return f"served: ready {ready_s:.0f}s after `up` (export included), probabilities {output['data']}"


@pytest.mark.parametrize("flavor", ["v2", "v1"])
def test_compose_trains_the_synthetic_example(flavor, docker_client, image, tmp_path):
    flavors = available()
    if not flavors:
        pytest.fail("neither `docker compose` (v2) nor `docker-compose` (1.29) is installed; "
                    "`sudo bash .ci/compose.sh` installs both", pytrace=False)
    if flavor not in flavors:
        pytest.skip(f"Compose {flavor} is not installed (ran with {', '.join(flavors)})")
    compose = flavors[flavor]
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
        assert summary["auc"] >= AUC_THRESHOLD, f"AUC {summary['auc']:.4f} < {AUC_THRESHOLD}\n{output}"
        assert summary["oracle_auc"] is not None, f"no oracle_auc although synth wrote oracle.json\n{output}"
        wall = [line for line in proc.stderr.splitlines() if "compose run took" in line]
        print(f"compose {flavor}: AUC {summary['auc']:.4f}; {wall[-1] if wall else ''}")
        served = serve_and_predict(compose, project, env, docker_client)  # ~20 s more than training alone
        print(f"compose {flavor}: {served}")
    finally:
        subprocess.run([*compose, "-p", project, "--profile", "serve", "down", "--volumes", "--remove-orphans"],
                       cwd=REPO, env=env, capture_output=True, timeout=300)
    leftovers = docker_client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
    assert not leftovers, f"containers left behind: {[c.name for c in leftovers]}"
    volumes = docker_client.volumes.list(filters={"label": f"com.docker.compose.project={project}"})
    assert not volumes, f"volumes left behind: {[v.name for v in volumes]}"
