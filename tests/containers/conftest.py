"""Fixtures of the container tests: a Docker engine, the image, synthetic data.

The container tests FAIL (never skip) when no Docker engine answers: CI
starts one with .ci/docker-engine.sh, and a green run must mean the
containers really ran. Testcontainers' Ryuk reaper image cannot be pulled
here, so Ryuk is off and the fixtures remove what they create themselves.
"""
from __future__ import annotations

import os
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

# Before testcontainers reads its configuration.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

import docker  # noqa: E402

from tests.containers.cluster import REPO, make_volume, run_once  # noqa: E402

IMAGE = os.environ.get("HYBRIDREC_IMAGE", "hybridrec:latest")
SYNTH_ROWS = int(os.environ.get("HYBRIDREC_TEST_ROWS", "100000"))
"""Training rows of the synthetic set the container tests train on."""
AUC_THRESHOLD = float(os.environ.get("HYBRIDREC_TEST_AUC", "0.70"))
"""Eval AUC a container run must reach (the 100k-row set gives ~0.78)."""
SOURCES = ["pyproject.toml", "hybridrec", "services", "protos", "deploy/Dockerfile", "deploy/build-base.sh"]
"""What the image is built from: newer files than the image mean a rebuild (build-base.sh: what the base holds,
nats-server among it; build-image.sh rebuilds the base when its package list changed)."""


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/containers/" in str(item.fspath) and "docker_client" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.containers)


@pytest.fixture(scope="session")
def docker_client():
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    error = None
    try:
        client = docker.from_env(timeout=300)
        client.ping()
    except Exception as exc:  # DockerException, ConnectionError, PermissionError...
        error = f"{type(exc).__name__}: {exc}"
    if error:
        pytest.fail(
            f"no Docker engine reachable at {where} ({error}).\n"
            "The container tests need one and fail rather than skip without it: "
            "start one with `sudo bash .ci/docker-engine.sh` (CI's .ci/run does).",
            pytrace=False,
        )
    yield client
    client.close()


def _newest_source_mtime() -> float:
    newest = 0.0
    for entry in SOURCES:
        path = REPO / entry
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        newest = max([newest] + [p.stat().st_mtime for p in files])
    return newest


@pytest.fixture(scope="session")
def image(docker_client) -> str:
    """The hybridrec image, built by deploy/build-image.sh when missing or older than the sources."""
    reason = None
    try:
        created = docker_client.images.get(IMAGE).attrs["Created"]  # 2026-11-22T11:52:06.123456789Z
        created = re.sub(r"\.(\d{1,6})\d*", r".\1", created).replace("Z", "+00:00")
        built = datetime.fromisoformat(created).timestamp()
        if built < _newest_source_mtime() and os.environ.get("HYBRIDREC_IMAGE_PREBUILT") != "1":
            reason = "older than the sources"
    except docker.errors.ImageNotFound:
        reason = "missing"
    if reason:
        proc = subprocess.run(["bash", str(REPO / "deploy" / "build-image.sh")], cwd=REPO,
                              env={**os.environ, "IMAGE": IMAGE}, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"image {IMAGE} is {reason} and deploy/build-image.sh failed:\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    return IMAGE


@pytest.fixture(scope="session")
def synthetic_data(docker_client, image) -> str:
    """A volume holding the synthetic set, written by `hybridrec data synth` in a container."""
    volume = make_volume(docker_client, "hybridrec-data")
    code, logs = run_once(docker_client, image,
                          ["data", "synth", "--out", "/data", "--rows", str(SYNTH_ROWS)],
                          {volume: {"bind": "/data", "mode": "rw"}}, timeout_s=300)
    assert code == 0, f"`hybridrec data synth` in a container exited {code}:\n{logs[-3000:]}"
    yield volume
    docker_client.volumes.get(volume).remove(force=True)


@pytest.fixture(scope="session")
def log_root(tmp_path_factory) -> Path:
    """Where each cluster leaves its containers' full logs (kept by pytest's tmp retention)."""
    return Path(os.environ.get("HYBRIDREC_TEST_LOGS") or tmp_path_factory.mktemp("container-logs"))
