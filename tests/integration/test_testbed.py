"""The multi-host testbed (benchmarks/testbed): a short run across two network-namespace hosts.

Training must cross the veth link (bytes counted on it), every service must
listen on its host's address (not loopback), and nothing with the run's prefix
may be left afterwards: after success, after a service killed mid-run, after
SIGINT/SIGTERM to the testbed, and after a failed link creation. Needs root.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.testbed import net
from benchmarks.testbed.bed import Testbed, TestbedError
from benchmarks.testbed.spec import two_hosts
from hybridrec.core.config import load_config
from tests.conftest import REPO, write_config
from tests.testbed_support import assert_torn_down, require_netns

pytestmark = [pytest.mark.integration, pytest.mark.testbed]


@pytest.fixture(autouse=True)
def _root():
    require_netns()


def _prefix() -> str:
    return f"hrt{os.getpid() % 100000}"


def _listening(bed: Testbed) -> dict[str, list[str]]:
    """Every host's listening TCP addresses (ss inside the host's namespace)."""
    out = {}
    for host in bed.spec.hosts:
        text = subprocess.run(["ip", "netns", "exec", net.host_ns(bed.prefix, host.name), "ss", "-Hltn"],
                              capture_output=True, text=True).stdout
        out[host.name] = [line.split()[3] for line in text.splitlines() if line.strip()]
    return out


def test_training_crosses_the_link_and_teardown_is_complete(tmp_path, small_data):
    config = load_config(write_config(tmp_path / "config.yaml", small_data))
    prefix = _prefix()
    seen: dict = {}

    def tick(bed: Testbed) -> None:
        if "train_done" not in bed.marks and "ready" in bed.marks and not seen:
            seen.update(_listening(bed))

    with Testbed(config, two_hosts("500mbit"), tmp_path / "run", prefix=prefix, on_tick=tick, timeout_s=600) as bed:
        assert sorted(net.namespaces(prefix)) == sorted([f"{prefix}-br", f"{prefix}-trainer", f"{prefix}-embedding"])
        result = bed.run()
        pids = [p.popen.pid for p in bed.procs]
    assert_torn_down(prefix, pids)

    summary = result["summary"]
    assert summary["steps"] > 0 and summary["auc"] > 0.6 and summary["lost_updates"] == 0
    assert summary["exposed_wait_per_step_s"] >= 0 and summary["compute_per_step_s"] > 0
    # Embeddings (EW -> NN), gradients (NN -> EW) and IDs (DL -> EW) all cross the embedding host's link.
    link = result["train"]["links"]["embedding"]
    assert link["tx_bytes"] > 1_000_000 and link["rx_bytes"] > 1_000_000, link
    assert result["bytes_per_step"]["embedding"] > 100_000
    assert result["train"]["cpu_s"]["trainer"] > 0 and result["train"]["cpu_s"]["embedding"] > 0
    # Every replica listens on its host's address, none on loopback or a wildcard.
    trainer, embedding = bed.spec.address("trainer"), bed.spec.address("embedding")
    for name, address in result["addresses"].items():
        assert address.split(":")[0] == (embedding if name.startswith("embedding") else trainer)
    assert seen, "never saw the services listening"
    for host, addresses in seen.items():
        hosts = {a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for a in addresses}  # v4-mapped too
        assert hosts == {bed.spec.address(host)}, (host, addresses)
    services = json.loads((tmp_path / "run" / "services.json").read_text())
    assert {s["host"] for s in services} == {"trainer", "embedding"}


def test_a_service_killed_mid_run_fails_the_run_and_leaves_nothing(tmp_path, small_data):
    config = load_config(write_config(tmp_path / "config.yaml", small_data))
    prefix = _prefix()
    pids: list[int] = []

    def kill_embedding_worker(bed: Testbed) -> None:
        if "ready" in bed.marks and not pids:
            pids.extend(p.popen.pid for p in bed.procs)
            victim = next(p for p in bed.procs if p.service == "embedding_worker")
            os.kill(victim.popen.pid, signal.SIGKILL)

    with pytest.raises(TestbedError, match="embedding_worker-0 on host embedding"):
        with Testbed(config, two_hosts(), tmp_path / "run", prefix=prefix, on_tick=kill_embedding_worker,
                     timeout_s=600) as bed:
            bed.run()
    assert pids
    assert_torn_down(prefix, pids)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_testbed_tears_everything_down(tmp_path, small_data, sig):
    config = write_config(tmp_path / "config.yaml", small_data)
    prefix = _prefix()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.testbed", "run", str(config), "--rate", "1gbit",
                             "--prefix", prefix, "--run-dir", str(run_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "services.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the testbed did not start its services"
        time.sleep(0.2)
    time.sleep(2)
    pids = [s["pid"] for s in json.loads((run_dir / "services.json").read_text())]
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert_torn_down(prefix, pids)


def test_cleanup_command_removes_leftovers_of_a_killed_testbed(tmp_path):
    prefix = _prefix()
    network = net.Network(two_hosts("1gbit"), prefix)
    network.create()  # and never destroyed: as if the testbed was killed with SIGKILL
    shm = net.Path(f"/dev/shm/{prefix}-shm-1")
    shm.mkdir()
    sleeper = subprocess.Popen(["ip", "netns", "exec", net.host_ns(prefix, "trainer"), "sleep", "300"])
    assert net.leftovers(prefix)
    done = subprocess.run([sys.executable, "-m", "benchmarks.testbed", "cleanup", "--prefix", prefix], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"namespace {prefix}-br" in done.stdout
    sleeper.wait(timeout=10)
    assert_torn_down(prefix, [sleeper.pid])


def test_a_failed_link_step_names_the_command_and_removes_what_was_made(monkeypatch):
    prefix = _prefix()
    real = net.tbf

    def tbf(ns, dev, rate):
        if ns.endswith("-embedding"):
            raise net.NetError(f"`tc qdisc replace dev {dev} root tbf` failed: simulated")
        real(ns, dev, rate)

    monkeypatch.setattr(net, "tbf", tbf)
    with pytest.raises(net.NetError, match="tbf` failed: simulated"):
        net.Network(two_hosts("1gbit"), prefix).create()
    assert net.leftovers(prefix) == []
