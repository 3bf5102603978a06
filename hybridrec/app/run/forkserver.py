"""Services forked from pre-imported parents: how `hybridrec run` starts (and restarts) its processes.

Every service is a Python process that imports numpy, numba, grpc (and, for an NN worker, torch) and loads
its compiled kernels before it can do anything; on a small machine, six of them doing so at once take
seconds of CPU each, and every restart after a failure pays it again. The fork servers pay it once: two
parent processes, started as `hybridrec run` starts, import what the services import and then fork a child
per service on request; the child runs `hybridrec serve NAME ...` in-process, as the executed command
would, with its own log file, environment and CPU set.

Two parents, because the NN workers' imports are most of the import time: the light parent (the data loader,
the PS shards, the embedding workers) imports numpy, numba, grpc and torch (the PS's and embedding worker's
fp16 codec), the dense one (NN workers, the model check) torch with `torch._dynamo` (3 more CPU-seconds) and
the NN worker's modules meanwhile, on another core. The light parent compiles or loads
the PS kernels once, before it forks the first PS (two PS processes no longer each compile them).

What a parent must not hold, because a fork copies only the calling thread and shares every descriptor:
no thread (torch's and OpenBLAS's pools stay unstarted: OMP_NUM_THREADS=1, and no tensor math; pyarrow,
which starts jemalloc's thread as it is imported, is left to the loader that reads Parquet), no gRPC channel
or server (gRPC supports fork only before either exists; each child creates its own), no open socket or
file beyond its pipes to the launcher and its log, no CUDA (on a GPU the NN worker initialises CUDA after
the fork). `check_fork_safe` asserts this before every fork; tests/unit/test_forkserver.py checks it from
outside.

Supervision stays with the launcher: a child is forked twice (the intermediate exits at once) so that it
becomes the launcher's own child (the launcher is a child subreaper), which waits for it, reads its exit
status and signals it exactly as before; a child dies with the launcher (PR_SET_PDEATHSIG, set once it is
the launcher's). A replacement is forked from the same parent; a parent that died is started again.

A parent is also the run's janitor: when its pipe from the launcher closes without a goodbye (the launcher
was killed), it waits until every child it forked is gone (they die with the launcher) and removes the
run's shared-memory directory, so a killed run leaves no processes and no /dev/shm behind.

Protocol: one JSON object per line each way. The launcher writes `{"op": "spawn", "argv": [...], "log":
PATH, "env": {...}, "cpus": [...] | null, "parent": PID}` and reads `{"pid": N}` or `{"error": TEXT}`;
`{"op": "config", "path": CONFIG}` gives the run's resolved config (the PS kernels are compiled for it);
`{"op": "clean_up", "path": DIR}` names what to remove if the launcher dies; `{"op": "exit"}` ends the
parent. A parent writes `{"ready": SECONDS}` once its imports are done.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
"""How long a forked child waits to become the launcher's (its intermediate parent exits at once)."""
FORK_ENV = {"PYTHONUNBUFFERED": "1", "HYBRIDREC_LOG_JSON": "1", "OMP_NUM_THREADS": "1"}
"""Set in every service's environment (and the parent's: what is read at import time is read there)."""


def libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)




class Forked:
    """A service process forked by the fork server and adopted by this process: the part of
    subprocess.Popen the launcher uses (pid, poll, wait, send_signal, returncode)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours (never adopted): it is gone or unreachable for us
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the process unless it was reaped (an unreaped child keeps its pid: never someone else's)."""
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServerError(RuntimeError):
    """The fork server could not start or fork a service."""


class ForkServer:
    """The launcher's handle on one parent process: `spawn` forks a service from it."""

    def __init__(self, log_path: Path, *, dense: bool = False, env: dict[str, str] | None = None):
        self.log_path, self.dense = Path(log_path), dense
        self.env = {**(env if env is not None else os.environ), **FORK_ENV}
        self._proc: subprocess.Popen | None = None
        self._settings: list[dict] = []  # config and clean-up: sent again to a parent started again
        self._waiting: deque[list[str]] = deque()  # submitted, not yet collected
        self.ready_s: float | None = None
        """Seconds the parent took to import what it forks with (from its `ready` line)."""

    def start(self) -> None:
        """Start the parent (it imports in the background; the first `spawn` waits for it)."""
        if libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise ForkServerError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
        # --for: which run it serves, for ps and top (the parent itself does not need it)
        cmd = [sys.executable, "-m", "hybridrec.app.run.forkserver_parent", "--for", str(self.log_path.parent),
               *(["--dense"] if self.dense else [])]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                          env=self.env, close_fds=True,
                                          # SIGTERM, not SIGKILL: it cleans up (see `Parent.janitor`)
                                          preexec_fn=functools.partial(die_with_parent, sig=signal.SIGTERM))
        self.ready_s = None
        self._waiting.clear()
        for message in self._settings:
            self._send(message)

    def configure(self, config_path: Path) -> None:
        """The run's resolved config (the light parent compiles the PS kernels for it)."""
        self._setting({"op": "config", "path": str(config_path)})

    def clean_up_on_death(self, path: str | Path) -> None:
        """Have the parent remove `path` if this process dies without `close` (a killed launcher)."""
        self._setting({"op": "clean_up", "path": str(path)})

    def _setting(self, message: dict) -> None:
        self._settings.append(message)
        if self.alive:
            self._send(message)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def wait_ready(self) -> float:
        """Block until the parent has imported everything; the seconds that took."""
        while self.ready_s is None:
            line = self._proc.stdout.readline()
            if not line:
                raise ForkServerError(f"the fork server exited with code {self._proc.wait()} while it imported; "
                                      f"its log: {self.log_path}")
            self.ready_s = float(json.loads(line)["ready"])
        return self.ready_s

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
              cpus: set[int] | None = None) -> Forked:
        """Fork `hybridrec ARGV...` with stdout and stderr appended to `log_path` (`submit`, then `collect`)."""
        self.submit(argv, log_path, env=env, cpus=cpus)
        return self.collect()

    def submit(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
               cpus: set[int] | None = None) -> None:
        """Ask for a fork without waiting for it (a parent still importing answers later); a parent that died is
        started again first."""
        if not self.alive:
            if self._proc is not None:
                self._reap()
            self.start()
        self._send({"op": "spawn", "argv": list(argv), "log": str(log_path), "parent": os.getpid(),
                    "env": {**(env if env is not None else self.env), **FORK_ENV},
                    "cpus": sorted(cpus) if cpus is not None else None})
        self._waiting.append(list(argv))

    def collect(self) -> Forked:
        """The process of the oldest `submit` not yet collected."""
        argv = self._waiting.popleft()
        reply = self._receive()
        if "error" in reply:
            raise ForkServerError(f"the fork server could not start `hybridrec {' '.join(argv)}`: {reply['error']}")
        return Forked(int(reply["pid"]))

    def _send(self, message: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(message).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ForkServerError(f"the fork server is gone ({exc}); its log: {self.log_path}") from None

    def _receive(self) -> dict:
        self.wait_ready()
        line = self._proc.stdout.readline()
        if not line:
            raise ForkServerError(f"the fork server exited with code {self._proc.wait()} before it answered; "
                                  f"its log: {self.log_path}")
        return json.loads(line)

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        proc.wait()

    def close(self) -> None:
        """End the parent (its children stay: they are this process's)."""
        if self._proc is None:
            return
        if self.alive:
            try:
                self._send({"op": "exit"})
            except ForkServerError:
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._reap()


class ForkServers:
    """The light and the dense parent of one run (see the module docstring): `spawn` picks the one a
    command's imports are in."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None):
        self.light = ForkServer(Path(log_dir) / "forkserver.log", env=env)
        self.dense = ForkServer(Path(log_dir) / "forkserver-dense.log", dense=True, env=env)

    def start(self) -> None:
        self.dense.start()  # the longer import first
        self.light.start()

    def configure(self, config_path: Path) -> None:
        self.light.configure(config_path)

    def clean_up_on_death(self, path: str | Path) -> None:
        self.light.clean_up_on_death(path)
        self.dense.clean_up_on_death(path)

    def _for(self, argv: list[str]) -> ForkServer:
        return self.dense if needs_dense(argv) else self.light

    def spawn(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
              cpus: set[int] | None = None) -> Forked:
        return self._for(argv).spawn(argv, log_path, env=env, cpus=cpus)

    def submit(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
               cpus: set[int] | None = None) -> None:
        self._for(argv).submit(argv, log_path, env=env, cpus=cpus)

    def collect(self, argv: list[str]) -> Forked:
        """The process of the oldest submit of `argv`'s parent (collect in the order of submitting)."""
        return self._for(argv).collect()

    @property
    def log_paths(self) -> list[Path]:
        return [self.light.log_path, self.dense.log_path]

    def close(self) -> None:
        self.light.close()
        self.dense.close()


def die_with_parent(cpus: set[int] | None = None, sig: int = signal.SIGKILL) -> None:
    """In a child of the launcher (an executed service before exec, a forked one once adopted, a fork-server
    parent): get `sig` when the launcher dies, leave the terminal's process group, and run on `cpus` when
    given (inherited by exec and fork)."""
    libc().prctl(PR_SET_PDEATHSIG, sig)
    os.setsid()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)

def needs_dense(argv: list[str]) -> bool:
    """Forked from the dense parent: an NN worker, the model check."""
    return argv[:2] == ["serve", "nn_worker"] or argv[:1] == ["check"]
