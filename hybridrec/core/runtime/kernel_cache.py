"""Where numba keeps the project's compiled kernels: once per machine, not once per checkout.

numba compiles a kernel on its first call (a second or more each on the
2-vCPU development machine: half a minute for a PS shard's store) and, with
`cache=True`, keeps the machine code on disk. By default it keeps it beside
the source, in the source directory's `__pycache__`, so every new checkout,
virtual environment or installed copy of the same code compiled everything
again; and it checks a cached kernel only against its own source file, so a
kernel that inlines a function of another module (the PS kernels inline the
row layout's `services/embedding_ps/row_storage.py`) could load machine code of
that module's old version.

`njit` here is numba's; the kernels it declares with `cache=True` are cached by `ProjectLocator` in one
directory per machine (`NUMBA_CACHE_DIR` when set, the container image's way;
else `$XDG_CACHE_HOME/hybridrec/kernels`, `~/.cache/hybridrec/kernels`), in a
subdirectory named by the *kernel build*: a hash of numba's and Python's
versions and of every project source file that holds a kernel. Any copy of
the same code on the machine, wherever its files are, loads the kernels the
first one compiled; a change to any kernel file gives a new build (every
kernel compiled again, never one of an older layout). numba keys each cached
kernel by its signature and the CPU (name and features) inside the build, so
entries of another CPU are never loaded: the kernel compiles and is added.

Processes that start together (a job's two PS shards, say) need the same
kernels at the same moment. Each compile of a cached project kernel holds a
lock file of its own in the build directory (`fcntl.flock`, released by the
kernel's compile or its process's end), taken for a signature the process
does not hold yet: a second process that needs it waits
for the first one's compile and then loads it, rather than compiling it again
on the same cores. A kernel's callees are locked while it is compiled (the call graph
has no cycles, so two processes never wait for each other); a lock held past
`LOCK_WAIT_S` is given up on, logged, and the kernel compiled anyway.

A cache directory that cannot be written falls back to numba's own places
(the source's `__pycache__`, then numba's per-user directory), logged once:
kernels still compile and load, never a failed start. A kernel the cache
cannot take (a full disk) stays in the process that compiled it, logged once
(numba's save raised, which failed the compile).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import os
import shutil
import sys
import time
from pathlib import Path

import numba
import numba.core.caching as caching
from numba.core import sigutils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher

PROJECT = Path(__file__).resolve().parents[3]
"""The directory holding the `hybridrec` and `services` packages."""
PACKAGES = ("hybridrec", "services")
BUILDS_KEPT = 8
"""Kernel builds kept in the cache directory, newest first; older ones are removed when a new one is made."""
LOCK_WAIT_S = 600.0
"""How long a process waits for another's compile of a kernel before it compiles the kernel itself."""


def cache_root() -> Path:
    """The machine's kernel cache: `NUMBA_CACHE_DIR`, else the per-user cache directory."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridrec" / "kernels"


@functools.lru_cache(maxsize=None)
def kernel_sources() -> tuple[Path, ...]:
    """Every project source file that declares a kernel or a function kernels inline (names `njit`), this
    module aside, in a stable order."""
    found = []
    for package in PACKAGES:
        for path in sorted((PROJECT / package).rglob("*.py")):
            if path != Path(__file__).resolve() and b"njit" in path.read_bytes():
                found.append(path)
    return tuple(found)


@functools.lru_cache(maxsize=None)
def build_key() -> str:
    """The kernel build: numba's and Python's versions and the contents of every kernel source file."""
    digest = hashlib.sha256(f"numba {numba.__version__} python {sys.version}".encode())
    for path in kernel_sources():
        digest.update(str(path.relative_to(PROJECT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build_dir() -> Path:
    return cache_root() / build_key()


class ProjectLocator(caching._CacheLocator):
    """numba's cache locator for the project's kernels: the build directory (`build_dir`), one file per kernel
    named by its module, name and line, stamped with the build key rather than its own file's content."""

    def __init__(self, py_func, py_file: str):
        self._lineno = py_func.__code__.co_firstlineno
        self._path = build_dir()

    def get_cache_path(self) -> str:
        return str(self._path)

    def get_source_stamp(self) -> str:
        return build_key()

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file: str):
        """A locator for a function of the project; None for anyone else's (numba's own locators take those)
        and when the cache directory cannot be written (logged once)."""
        try:
            Path(py_file).resolve().relative_to(PROJECT)
        except ValueError:
            return None
        locator = cls(py_func, py_file)
        try:
            _prepare(locator._path)
        except OSError as exc:
            _unwritable(locator._path, exc)
            return None
        return locator


@functools.lru_cache(maxsize=None)
def _prepare(path: Path) -> None:
    """Create the build directory (once a process), checking it can be written, and prune old builds."""
    fresh = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
    if fresh:
        _prune(path.parent, keep=path)


def _prune(root: Path, keep: Path) -> None:
    """Remove all but the newest `BUILDS_KEPT` kernel builds under `root` (another checkout's may be in use:
    numba then compiles its kernels again, as without a cache)."""
    builds = [p for p in root.iterdir() if p.is_dir() and len(p.name) == 20 and p != keep]
    builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[BUILDS_KEPT - 1:]:
        shutil.rmtree(old, ignore_errors=True)


_REPORTED: set[tuple[str, Path]] = set()


def _unwritable(path: Path, exc: OSError) -> None:
    """Log once a process that the cache directory cannot be used."""
    _warn_once("kernel cache directory not writable: numba's own places instead", path, exc)


def _warn_once(message: str, path: Path, exc: OSError) -> None:
    """Log `message` about `path` once a process (each kernel of a process meets the same directory)."""
    if (message, path) in _REPORTED:
        return
    _REPORTED.add((message, path))
    from hybridrec.core.runtime import log

    log.get("kernel_cache").warning(message, path=str(path), error=str(exc))


def install() -> None:
    """Put `ProjectLocator` first in numba's cache locators (numba's own stay after it, for anyone else's
    functions and as the fallback). Where the user chose the locators (`NUMBA_CACHE_LOCATOR_CLASSES`, which
    numba reads instead of this list) their choice holds."""
    if ProjectLocator not in caching.CacheImpl._locator_classes:
        caching.CacheImpl._locator_classes.insert(0, ProjectLocator)


def njit(*args, **options):
    """`numba.njit`, after `install`: the project's kernels are declared with it (those with `cache=True` are
    cached per machine and compiled by one process at a time; an `inline="always"` helper is compiled into its
    callers)."""
    install()
    made = numba.njit(*args, **options)
    if not options.get("cache"):
        return made
    if isinstance(made, Dispatcher):
        return _one_compile_at_a_time(made)
    return lambda func: _one_compile_at_a_time(made(func))


def _one_compile_at_a_time(dispatcher: Dispatcher) -> Dispatcher:
    """`dispatcher` with its compiles locked across processes (`CompileLock`): a signature this process does
    not hold yet is loaded or compiled under the kernel's lock, so a process that wanted it while another
    compiled it waits and then loads it from the cache. The lock is released when that compile ends, saved or
    failed."""
    func = dispatcher.py_func
    locator = ProjectLocator.from_function(func, inspect.getfile(func))
    if locator is None:  # numba's own places: no shared directory to lock in
        return dispatcher
    lock = CompileLock(Path(locator.get_cache_path()) / "locks" / f"{func.__module__}.{func.__qualname__}.lock")
    compile_ = dispatcher.compile

    def compile(sig):
        if tuple(sigutils.normalize_signature(sig)[0]) in dispatcher.overloads:  # held already: no wait
            return compile_(sig)
        with global_compiler_lock:  # one thread of this process compiles at a time, as numba's own compile does
            depth = lock.depth
            try:
                lock.acquire()
                return compile_(sig)
            finally:
                lock.release_to(depth)

    dispatcher.compile = compile
    _save_or_say_why(dispatcher, Path(locator.get_cache_path()))
    return dispatcher


def _save_or_say_why(dispatcher: Dispatcher, path: Path) -> None:
    """Have `dispatcher`'s cache keep a kernel it cannot write (a full disk, a file size limit) in memory only,
    logged once a process, instead of failing the compile: numba's save raises, and a failed compile is a
    failed start. numba writes each file to a temporary name and renames it, the index last, so a save that
    failed leaves the cache as it was."""
    cache = getattr(dispatcher, "_cache", None)
    save = getattr(cache, "save_overload", None)
    if save is None:
        return

    def save_overload(sig, data):
        try:
            save(sig, data)
        except OSError as exc:
            _unsaved(path, exc)

    cache.save_overload = save_overload


def _unsaved(path: Path, exc: OSError) -> None:
    """Log once a process that a compiled kernel could not be written to the cache."""
    _warn_once("kernel cache not written (disk full?): kernels kept in this process only", path, exc)


class CompileLock:
    """One kernel's lock file, held (`flock`, exclusive) while this process compiles the kernel. Re-entrant
    within the process (a kernel compiled for a second signature while its first is typed): `depth` counts
    the holds, the file is unlocked when the last ends. Used under numba's compiler lock only."""

    def __init__(self, path: Path):
        self.path, self.depth, self._fd = path, 0, -1

    def acquire(self) -> bool:
        """Wait for the lock (at most `LOCK_WAIT_S`); False when it cannot be had (the directory cannot be
        written, or the wait ran out: logged), and the kernel is compiled without it."""
        if self.depth:
            self.depth += 1
            return True
        try:
            self.path.parent.mkdir(exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            _unwritable(self.path.parent, exc)
            return False
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    _log_lock_wait(self.path)
                    return False
                time.sleep(0.02)
        self._fd, self.depth = fd, 1
        return True

    def release_to(self, depth: int) -> None:
        """Release the holds taken since the count was `depth`."""
        if self.depth <= depth:
            return
        self.depth = depth
        if depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def _log_lock_wait(path: Path) -> None:
    from hybridrec.core.runtime import log

    log.get("kernel_cache").warning("kernel compile lock not released in time: compiling here as well",
                                    lock=str(path), waited_s=LOCK_WAIT_S)


_WATCHING: list[object] = []


def watch_compiles() -> None:
    """From now on, log every kernel numba compiles in this process (`kernel_compiled_while_serving`, a warning,
    with the kernel, its argument types and the seconds it took): a service calls it as it turns SERVING, after
    its warm-up compiled (or loaded) every kernel it runs, so one logged is a kernel the warm-up missed, compiled
    while requests wait. A kernel loaded from the cache is not a compile. Once a process."""
    if _WATCHING:
        return
    from numba.core import event

    from hybridrec.core.runtime import log

    class Watch(event.Listener):
        def __init__(self):
            self.started: dict[int, float] = {}

        def on_start(self, ev) -> None:
            self.started[id(ev.data["dispatcher"])] = time.perf_counter()

        def on_end(self, ev) -> None:
            dispatcher = ev.data["dispatcher"]
            began = self.started.pop(id(dispatcher), None)
            log.get().warning("kernel_compiled_while_serving", kernel=dispatcher.py_func.__qualname__,
                              module=dispatcher.py_func.__module__, args=str(ev.data.get("args")),
                              seconds=None if began is None else round(time.perf_counter() - began, 3))

    _WATCHING.append(Watch())
    event.register("numba:compile", _WATCHING[0])
