"""The fork server (hybridrec/app/run/forkserver.py): what its parent holds, what a forked service is, and what a
killed launcher or parent leaves behind. Real processes: a launcher stand-in (forkserver_launcher.py), the
fork server it starts, and services forked from it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hybridrec.app.run.ports import free_port
from tests.conftest import REPO

LAUNCHER = [sys.executable, str(REPO / "tests" / "unit" / "forkserver_launcher.py")]


class Launcher:
    """The stand-in, driven one request at a time."""

    def __init__(self, tmp_path: Path, clean_up: Path | None = None):
        self.tmp = tmp_path
        self.proc = subprocess.Popen([*LAUNCHER, str(tmp_path), *([str(clean_up)] if clean_up else [])], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the launcher stand-in died: {self.proc.wait()}"
        return json.loads(line)

    def spawn(self, argv: list[str], name: str) -> dict:
        return self.ask({"spawn": argv, "log": str(self.tmp / f"{name}.log")})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def ps_config(tmp_path: Path) -> tuple[Path, Path]:
    """A one-shard PS config (its shm under tmp_path/shm)."""
    shm = tmp_path / "shm"
    config = tmp_path / "ps.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": 8}],
        "ps": {"capacity": 1000, "num_stripes": 2, "shm_dir": str(shm)},
        "cluster": {"ps": [f"127.0.0.1:{free_port()}"], "bind_host": "127.0.0.1"}}))
    return config, shm


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def text(path: Path) -> str:
    """A child's log so far ("" until the child, which opens it after the fork, has)."""
    return path.read_text() if path.exists() else ""


def until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_parents_hold_one_thread_no_descriptor_but_their_pipes_and_no_cuda(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        config, _ = ps_config(tmp_path)
        launcher.ask({"config": str(config)})
        pids = launcher.ask({"ready": True})
        until(lambda: '"what": "ps kernels"' in text(tmp_path / "forkserver.log"), "the PS kernels (when idle)")
        for kind, pid in pids.items():
            assert os.listdir(f"/proc/{pid}/task") == [str(pid)], kind  # one thread
            fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            # Nothing else open: no socket, and no /dev/nvidia* (CUDA initialised opens them; a CUDA build of
            # torch maps libcuda as it is imported, which is harmless): CUDA comes after the fork.
            assert sorted(fds) == [0, 1, 2], (kind, fds)
            assert fds[0].startswith("pipe:") and fds[1].startswith("pipe:") and "forkserver" in fds[2], fds
            maps = Path(f"/proc/{pid}/maps").read_text()
            # torch in both (the PS's and the embedding worker's fp16 codec use it), and in both the numba
            # kernels their services run: the light parent's parser, dedup and PS kernels, the dense one's
            # CPU pooling
            assert "libtorch_cpu" in maps and "llvmlite" in maps, kind
        # Forking needs nothing the parents lack: a command forked now is the launcher's child.
        child = launcher.spawn(["check", str(config), "--only", "model"], "check")
        assert child["forkserver"] == pids["dense"]
        assert launcher.ask({"wait": child["pid"]}) == {"code": 0}
        assert "ps.yaml: model ok" in (tmp_path / "check.log").read_text()
    finally:
        launcher.close()


def test_a_forked_service_exits_with_its_own_code_and_message(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        config, _ = ps_config(tmp_path)
        bad = launcher.spawn(["serve", "embedding_ps", "--config", str(config), "--set", "ps.capacity=-5"], "bad")
        missing = launcher.spawn(["serve", "embedding_ps", "--config", str(tmp_path / "nowhere.yaml")], "missing")
        crash = launcher.spawn(["serve", "embedding_ps", "--config", str(config), "--replica", "3"], "crash")
        assert launcher.ask({"wait": bad["pid"]}) == {"code": 2}
        assert "ps.capacity" in (tmp_path / "bad.log").read_text()
        assert launcher.ask({"wait": missing["pid"]}) == {"code": 2}
        assert "nowhere.yaml" in (tmp_path / "missing.log").read_text()
        # An error the service does not expect: the interpreter's traceback and exit 1, as an executed one.
        assert launcher.ask({"wait": crash["pid"]}) == {"code": 1}
        text = (tmp_path / "crash.log").read_text()
        assert "Traceback" in text and "replica 3 of embedding_ps does not exist" in text
    finally:
        launcher.close()


def test_a_killed_launcher_leaves_no_process_and_no_shared_memory(tmp_path):
    config, shm = ps_config(tmp_path)
    launcher = Launcher(tmp_path, clean_up=shm)
    child = launcher.spawn(["serve", "embedding_ps", "--config", str(config)], "ps")
    until(lambda: '"serving"' in text(tmp_path / "ps.log") or gone(child["pid"]), "the PS to serve")
    assert not gone(child["pid"]) and psutil.Process(child["pid"]).ppid() == launcher.proc.pid
    assert psutil.Process(child["pid"]).name() == "hr-embedding_ps"
    assert (shm / "shard-00000").is_dir()
    launcher.proc.kill()
    launcher.proc.wait()
    until(lambda: gone(child["pid"]) and gone(child["forkserver"]), "the PS and the fork server to exit", 30)
    until(lambda: not shm.exists(), "the run's shared memory to be removed", 30)


def test_a_lost_fork_server_is_started_again_and_its_children_keep_running(tmp_path):
    config, _ = ps_config(tmp_path)
    launcher = Launcher(tmp_path)
    try:
        first = launcher.spawn(["serve", "embedding_ps", "--config", str(config)], "ps")
        until(lambda: '"serving"' in text(tmp_path / "ps.log"), "the PS to serve")
        os.kill(first["forkserver"], signal.SIGKILL)
        until(lambda: gone(first["forkserver"]), "the fork server to die")
        time.sleep(0.5)
        assert not gone(first["pid"])  # the service is the launcher's, not the fork server's
        second = launcher.spawn(["check", str(config), "--only", "model"], "check")
        assert second["forkserver"] != first["forkserver"]
        assert launcher.ask({"wait": second["pid"]}) == {"code": 0}
        os.kill(first["pid"], signal.SIGTERM)
        assert launcher.ask({"wait": first["pid"]}) == {"code": 0}
    finally:
        launcher.close()


def _ignored_signals(pid: int) -> set[int]:
    """The signals process `pid` ignores (/proc/PID/status SigIgn: bit n - 1 is signal n)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_a_forked_service_ignores_sigpipe_as_an_executed_interpreter_does(tmp_path):
    """A write to a closed socket must be an error the writer handles, not the death of the writer: with SIGPIPE
    at its default, a surviving NN worker died when its Gloo peer was SIGKILLed mid-send."""
    executed = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert executed.stdout.readline() == b"up\n"  # past the interpreter's start-up
        assert signal.SIGPIPE in _ignored_signals(executed.pid)  # what CPython sets there
    finally:
        executed.communicate(b"")
    config, _ = ps_config(tmp_path)
    launcher = Launcher(tmp_path)
    try:
        ps = launcher.spawn(["serve", "embedding_ps", "--config", str(config)], "ps")
        until(lambda: '"serving"' in text(tmp_path / "ps.log"), "the PS to serve")
        ignored = _ignored_signals(ps["pid"])
        assert signal.SIGPIPE in ignored and signal.SIGTERM not in ignored and signal.SIGINT not in ignored
        os.kill(ps["pid"], signal.SIGTERM)
        assert launcher.ask({"wait": ps["pid"]}) == {"code": 0}
    finally:
        launcher.close()


@pytest.mark.parametrize("only, message", [("model", "nowhere.module"), (None, "unused.tsv")])
def test_check_names_what_is_wrong(tmp_path, only, message):
    """`hybridrec check` (what `hybridrec run` forks beside the start-up, --only model): exit 2, naming it."""
    config, _ = ps_config(tmp_path)
    args = [sys.executable, "-m", "hybridrec", "check", str(config), "--set", "model.path=nowhere.module:Model"]
    result = subprocess.run(args + (["--only", only] if only else []), cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_check_refuses_an_unknown_part(tmp_path):
    config, _ = ps_config(tmp_path)
    result = subprocess.run([sys.executable, "-m", "hybridrec", "check", str(config), "--only", "everything"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--only is 'data' or 'model', not 'everything'" in result.stderr, result.stderr
