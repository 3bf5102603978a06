"""The fork servers' parent program: `python -m hybridrec.app.run.forkserver_parent [--dense]`, started by
`hybridrec.app.run.forkserver.ForkServer` (the launcher's side, which documents the protocol). It imports what the
services import, then forks a child per request that runs `hybridrec ARGV...` in-process through the CLI.

A module of its own because it runs the CLI, and the CLI (through the launcher) starts it: the launcher's side
does not import the CLI, so the app's modules import in one direction.
"""
from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import setproctitle

from hybridrec.app.run.forkserver import die_with_parent, libc

PR_SET_NAME = 15
REPARENT_TIMEOUT_S = 10.0
IDLE_S = 5.0
"""The light parent compiles the PS kernels once no request came for this long, if no PS asked first (not
while the first services start on the same cores)."""


def preload_base() -> None:
    """What the data loader, PS and embedding worker import, and the loader's and worker's kernels.

    torch too: the PS shards and the embedding workers use it for fp16 values (`hybridrec.core.wire.compress`), and
    each of them imported it after the fork (1.8-2.4 s of CPU apiece, three processes in the smallest run,
    on the cores the dense parent was importing torch on): imported once here, their children share it."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
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
    and the NN worker's modules, and the CPU pooling's numba kernels (each NN worker loaded them at its first
    step: about a CPU-second apiece)."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported by DDP and the optimizer whether or not anything is compiled)

    from hybridrec.core.model import bag_kernels
    from hybridrec.app import cli  # noqa: F401
    from services.nn_worker import progressive, server as _nn  # noqa: F401

    bag_kernels.warm_up()  # the CPU pooling's kernels (a GPU pools with torch's embedding_bag instead)
    progressive.warm_up()


def warm_up_ps(config_path: Path) -> None:
    """Compile (or load from numba's cache) the PS kernels for the run's config, on a scratch table.

    A forked helper warms up the update kernels meanwhile (`warm_up(updates_first=True)`): on a cold cache
    the lookups' kernels and the updates' then compile on both cores instead of one after the other, and
    this process loads the helper's from the cache. The helper is killed once this process holds every
    kernel: what it has left to do is load the ones this process compiled."""
    from hybridrec.core.config import load_config
    from services.embedding_ps import server as ps_server

    config = load_config(config_path, [])
    helper = os.fork()
    if helper == 0:
        code = 1
        try:
            die_with_parent()
            ps_server.warm_up(config, updates_first=True)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        ps_server.warm_up(config)
    finally:
        os.kill(helper, signal.SIGKILL)
        os.waitpid(helper, 0)




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
            self.load(lambda: warm_up_ps(self.config_path), "ps kernels")
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
    def load(what, name: str) -> None:
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
        libc().prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        # The dispositions an executed interpreter starts with. SIGPIPE ignored, as CPython sets it: a write to a
        # closed socket is then an error the writer handles. Left at its default it killed a surviving NN worker
        # whose Gloo peer was SIGKILLed mid-send (Gloo writes without MSG_NOSIGNAL): one lost rank became two.
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
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
    Parent.load(preload_dense if dense else preload_base, "dense" if dense else "base")
    replies.write(json.dumps({"ready": round(time.monotonic() - started, 3)}).encode() + b"\n")
    replies.flush()
    Parent(sys.stdin.fileno(), replies).serve()


if __name__ == "__main__":
    main()
