"""Shared by the testbed tests: skip without root or iproute2, and the leftover checks."""
from __future__ import annotations

import os
import shutil
import subprocess

import psutil
import pytest

from benchmarks.testbed.net import leftovers


def require_netns() -> None:
    """Skip on a developer's machine without root or iproute2; in CI (CI set, as .ci/run runs) fail instead:
    there the testbed must run, not be counted as passing."""
    missing = pytest.fail if os.environ.get("CI") else pytest.skip
    if os.geteuid() != 0:
        missing("the testbed needs root (network namespaces); CI runs as root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        missing("iproute2 (ip, tc) is not installed (.ci/run installs it)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        missing(f"ip netns does not work here: {probe.stderr.strip()}")


def assert_torn_down(prefix: str, pids: list[int]) -> None:
    """No namespace (hence no veth link) or shm directory with the prefix, and none of the processes alive."""
    assert leftovers(prefix) == []
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes left: {alive}"
