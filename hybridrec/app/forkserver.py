"""Services forked from pre-imported parents: how `hybridrec run` starts (and restarts) its processes.

Every service is a Python process that imports numpy, numba, grpc (and, for an NN worker, torch) and loads
its compiled kernels before it can do anything; on a small machine, six of them doing so at once take
seconds of CPU each, and every restart after a failure pays it again. The fork servers pay it once: two
parent processes, started as `hybridrec run` starts, import what the services import and then fork a child
per service on request; the child runs `hybridrec serve NAME ...` in-process, as the executed command
would, with its own log file, environment and CPU set.

Two parents, because torch is most of the import time and only the NN workers need it: the light parent
(the data loader, the PS shards, the embedding workers) is ready in well under a second, the dense one
(NN workers, the model check) imports torch meanwhile, on another core. The light parent compiles or loads
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
import gc
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import setproctitle

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
REPARENT_TIMEOUT_S = 10.0
"""How long a forked child waits to become the launcher's (its intermediate parent exits at once)."""
FORK_ENV = {"PYTHONUNBUFFERED": "1", "HYBRIDREC_LOG_JSON": "1", "OMP_NUM_THREADS": "1"}
"""Set in every service's environment (and the parent's: what is read at import time is read there)."""
IDLE_S = 5.0
"""The light parent compiles the PS kernels once no request came for this long, if no PS asked first (not
while the first services start on the same cores)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


# ---------------------------------------------------------------------------------------------------------
# The launcher's side


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
        if _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise ForkServerError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
        # --for: which run it serves, for ps and top (the parent itself does not need it)
        cmd = [sys.executable, "-m", "hybridrec.app.forkserver", "--for", str(self.log_path.parent),
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
    _libc().prctl(PR_SET_PDEATHSIG, sig)
    os.setsid()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


# ---------------------------------------------------------------------------------------------------------
# The parent's side


def preload_base() -> None:
    """What the data loader, PS and embedding worker import, and the loader's and worker's kernels."""
    import numpy  # noqa: F401
    import grpc  # noqa: F401
    import grpc.aio  # noqa: F401
    import uvloop  # noqa: F401

    from hybridrec.app import cli  # noqa: F401
    from services.dataloader import server as _loader, tsv
    from services.embedding_ps import server as _ps  # noqa: F401
    from services.embedding_worker import server as ew_server

    tsv.warm_up()  # the kernels of the data loader and the embedding worker (the PS's: `warm_up_ps`)
    ew_server.warm_up()


def preload_dense() -> None:
    """What an NN worker and the model check import: torch (about 2 core-s, torch._dynamo included), the CLI
    and the NN worker's modules."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported by DDP and the optimizer whether or not anything is compiled)

    from hybridrec.app import cli  # noqa: F401
    from services.nn_worker import server as _nn  # noqa: F401


def warm_up_ps(config_path: Path) -> None:
    """Compile (or load from numba's cache) the PS kernels for the run's config, on a scratch table."""
    from hybridrec.config import load_config
    from services.embedding_ps import server as ps_server

    ps_server.warm_up(load_config(config_path, []))


def needs_dense(argv: list[str]) -> bool:
    """Forked from the dense parent: an NN worker, the model check."""
    return argv[:2] == ["serve", "nn_worker"] or argv[:1] == ["check"]


def check_fork_safe() -> None:
    """Raise unless this process can fork a service: one thread, no descriptor but its pipes and its log, no
    CUDA context (see the module docstring)."""
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    extra = [(fd, target) for fd in fds if fd > 2 and (target := _describe_fd(fd)) is not None]
    if extra:
        raise RuntimeError(f"the fork server holds descriptors its children would share: {extra}")
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1 or threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        raise RuntimeError(f"the fork server runs {len(threads)} threads ({names}): a fork would copy one")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("the fork server initialised CUDA: its children could not use the GPU")


def _describe_fd(fd: int) -> str | None:
    """What descriptor `fd` is open on; None when it is not open (the listing's own, closed by now)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


@dataclass
class Parent:
    """A fork server's loop: reads requests on its stdin, answers on its stdout. The light parent compiles the
    PS kernels before it forks the first PS, or once it is idle.

    Nothing else is loaded later: scikit-learn, which the NN workers import for evaluation, may bring
    pyarrow (through pandas, where it is installed) and with it jemalloc's thread; it stays the NN
    workers' own import."""

    requests: int
    """The descriptor requests come in on (read directly: `select` must see what is not yet consumed)."""
    replies: IO[bytes]
    config_path: Path | None = None
    warmed: bool = False
    children: list[int] = field(default_factory=list)
    clean_up: list[str] = field(default_factory=list)
    _buffer: bytes = b""

    def serve(self) -> None:
        while True:
            line = self._next_line()
            if line is None:
                break
            request = json.loads(line)
            op = request.get("op")
            if op == "exit":
                return
            if op == "clean_up":
                self.clean_up.append(request["path"])
            elif op == "config":
                self.config_path = Path(request["path"])
            elif op == "spawn":
                if request["argv"][:2] == ["serve", "embedding_ps"]:
                    self._warm_up()
                self._reply(self._spawn(request))
        self.janitor()  # the launcher is gone without a goodbye

    def _warm_up(self) -> None:
        if not self.warmed and self.config_path is not None:
            self._load(lambda: warm_up_ps(self.config_path), "ps kernels")
            self.warmed = True

    def _next_line(self) -> bytes | None:
        """The next request line; None once the launcher closed its end. After IDLE_S without one, the PS
        kernels are compiled first if they are due (a run that has not asked for its PS shards yet)."""
        while b"\n" not in self._buffer:
            due = self.config_path is not None and not self.warmed
            if due and not select.select([self.requests], [], [], IDLE_S)[0]:
                self._warm_up()
                continue
            chunk = os.read(self.requests, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    @staticmethod
    def _load(what, name: str) -> None:
        started = time.monotonic()
        what()
        gc.collect()
        gc.freeze()  # what the imports made is never scanned again: fewer copied pages in the children
        print(json.dumps({"event": "preloaded", "what": name, "seconds": round(time.monotonic() - started, 3),
                          "at": round(time.time(), 3)}),
              file=sys.stderr, flush=True)

    def _reply(self, message: dict) -> None:
        self.replies.write(json.dumps(message).encode() + b"\n")
        self.replies.flush()

    def _spawn(self, request: dict) -> dict:
        try:
            check_fork_safe()
            read_end, write_end = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            middle = os.fork()
            if middle == 0:  # the intermediate: forks the service, says its pid, exits (so it is adopted)
                try:
                    os.close(read_end)
                    pid = os.fork()
                    if pid == 0:
                        os.close(write_end)
                        _child(request)  # never returns
                    os.write(write_end, str(pid).encode())
                finally:
                    os._exit(0)
            os.close(write_end)
            with os.fdopen(read_end, "rb") as f:
                pid = int(f.read() or 0)
            os.waitpid(middle, 0)
            if not pid:
                return {"error": "the intermediate process died before it forked the service"}
            self.children.append(pid)
            return {"pid": pid}
        except Exception as exc:  # the parent keeps serving: the launcher decides what a failed start means
            return {"error": f"{type(exc).__name__}: {exc}"}

    def janitor(self) -> None:
        """The launcher died: wait for the children it took with it, then remove the run's shared memory."""
        deadline = time.monotonic() + 30
        while self.children and time.monotonic() < deadline:
            self.children = [pid for pid in self.children if _exists(pid)]
            time.sleep(0.05)
        for path in self.clean_up:
            shutil.rmtree(path, ignore_errors=True)


def _exists(pid: int) -> bool:
    """The process runs (a zombie counts as gone: it holds no memory and no files)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _child(request: dict) -> None:
    """In the forked service: become the launcher's child, take its log, environment and CPUs, then run the
    command as `hybridrec ARGV...` would and exit with its code."""
    code = 1
    try:
        deadline = time.monotonic() + REPARENT_TIMEOUT_S
        while os.getppid() != request["parent"]:  # the intermediate is exiting; the launcher adopts this one
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.0005)
        die_with_parent(set(request["cpus"]) if request.get("cpus") is not None else None)
        if os.getppid() != request["parent"]:  # the launcher died meanwhile
            os._exit(1)
        argv = request["argv"]
        # What ps, top and /proc show: the command an executed service would have, not the parent's.
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "hybridrec", *argv]))
        name = f"hr-{argv[1] if argv[0] == 'serve' and len(argv) > 1 else argv[0]}"
        _libc().prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["hybridrec", *request["argv"]]
        code = _run_command(request["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        _exit_like_interpreter(code)


def _run_command(argv: list[str]) -> int:
    """`hybridrec ARGV...` in this process: its exit code, an uncaught exception printed as the interpreter
    would print it (exit 1)."""
    from hybridrec.app.cli import app

    try:
        app(args=argv, prog_name="hybridrec")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        return 130
    return 0


def _exit_like_interpreter(code: int) -> None:
    """What the interpreter does at exit, then exit without unwinding into the fork server's own frames:
    wait for non-daemon threads, run atexit callbacks, flush."""
    try:
        threading._shutdown()
    except Exception:
        pass
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main() -> None:
    started = time.monotonic()
    dense = "--dense" in sys.argv[1:]
    signal.signal(signal.SIGTERM, lambda *_: None)  # PDEATHSIG: the closed pipe ends the loop, then the janitor
    replies = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing the imports print may land in the reply pipe
    Parent._load(preload_dense if dense else preload_base, "dense" if dense else "base")
    replies.write(json.dumps({"ready": round(time.monotonic() - started, 3)}).encode() + b"\n")
    replies.flush()
    Parent(sys.stdin.fileno(), replies).serve()


if __name__ == "__main__":
    main()
