"""docker-compose.yml trains the synthetic example to completion, with each installed Compose.

Runs deploy/compose/train.sh (`up --exit-code-from nn-worker-0 nn-worker-0`,
then the summary, then cleanup) on a small synthetic set, once with Compose
v2 (`docker compose`) and once with Debian's docker-compose 1.29, whichever
are installed; at least one must be. Each run has its own project name and
removes its containers and volumes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from tests.containers.cluster import REPO
from tests.containers.conftest import AUC_THRESHOLD, IMAGE, SYNTH_ROWS

COMPOSE_TIMEOUT_S = 900


def available() -> dict[str, list[str]]:
    found = {}
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        found["v2"] = ["docker", "compose"]
    if shutil.which("docker-compose"):
        found["v1"] = ["docker-compose"]
    return found


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
    finally:
        subprocess.run([*compose, "-p", project, "down", "--volumes", "--remove-orphans"], cwd=REPO,
                       env=env, capture_output=True, timeout=300)
    output = f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"{' '.join(compose)} run failed ({proc.returncode}):\n{output}"
    summary = json.loads(summary_path.read_text())
    assert summary["samples"] == SYNTH_ROWS, output
    assert summary["auc"] >= AUC_THRESHOLD, f"AUC {summary['auc']:.4f} < {AUC_THRESHOLD}\n{output}"
    assert summary["oracle_auc"] is not None, f"no oracle_auc although synth wrote oracle.json\n{output}"
    wall = [line for line in proc.stderr.splitlines() if "compose run took" in line]
    print(f"compose {flavor}: AUC {summary['auc']:.4f}; {wall[-1] if wall else ''}")
    leftovers = docker_client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
    assert not leftovers, f"containers left behind: {[c.name for c in leftovers]}"
