"""Kernels compiled once per machine (hybridrec/core/runtime/kernel_cache.py): a second copy of the same code at another
path
loads what the first compiled; an edit to any kernel file is a new build; a cache directory that cannot be
written, or a disk too full to take a kernel, falls back to compiling, logged once, and the kernel still runs;
another CPU's entries are never loaded."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hybridrec.core.runtime import kernel_cache

PROBE = """
import json
from hybridrec.core.wire import dedup
from hybridrec.core.runtime import kernel_cache
import numpy as np
ids = np.array([5, 3, 5, 9], np.uint64)
uniq, inverse = dedup.unique_inverse(ids)
stats = dedup._unique_inverse.stats
print(json.dumps({"uniq": sorted(int(u) for u in uniq), "module": kernel_cache.__file__,
                  "build": kernel_cache.build_key(), "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


def _copy_project(to: Path) -> Path:
    """The two packages, as a second checkout would hold them (no compiled files)."""
    for package in kernel_cache.PACKAGES:
        shutil.copytree(kernel_cache.PROJECT / package, to / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    return to


def _probe(project: Path, cache_home: Path, prelude: str = "") -> tuple[dict, str]:
    """PROBE run in a fresh process on `project` with the per-user cache under `cache_home`, after `prelude`
    (code that sets the process up: a file size limit, another CPU's name); (its result, its output)."""
    env = {**os.environ, "PYTHONPATH": str(project), "XDG_CACHE_HOME": str(cache_home)}
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", prelude + PROBE], cwd=project, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stdout + out.stderr


def test_a_second_checkout_loads_the_kernels_the_first_compiled_and_an_edit_compiles_again(tmp_path):
    cache = tmp_path / "cache"
    first, _ = _probe(_copy_project(tmp_path / "one"), cache)
    assert first["module"].startswith(str(tmp_path / "one")) and first["uniq"] == [3, 5, 9]
    assert (first["misses"], first["hits"]) == (1, 0)  # compiled: nothing was cached
    second, _ = _probe(_copy_project(tmp_path / "two"), cache)
    assert second["module"].startswith(str(tmp_path / "two")) and second["build"] == first["build"]
    assert (second["misses"], second["hits"]) == (0, 1)  # the same code elsewhere: loaded
    kernels = tmp_path / "two" / "services" / "embedding_ps" / "row_storage.py"  # inlined by other modules
    kernels.write_text(kernels.read_text() + "\n# edited\n")
    edited, _ = _probe(tmp_path / "two", cache)
    assert edited["build"] != first["build"] and (edited["misses"], edited["hits"]) == (1, 0)
    assert sorted(p.name for p in (cache / "hybridrec" / "kernels").iterdir()) == sorted(
        [first["build"], edited["build"]])


def test_a_cache_directory_that_cannot_be_written_compiles_and_says_so_once(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    result, output = _probe(_copy_project(tmp_path / "one"), tmp_path / "file")  # the cache's parent is a file
    assert result["uniq"] == [3, 5, 9] and result["misses"] == 1
    assert output.count("kernel cache directory not writable") == 1, output


def test_a_cache_that_cannot_take_a_kernel_keeps_it_in_memory_and_says_so_once(tmp_path):
    """A full disk (here a file size limit: every write of a cache file fails): the kernels compile and run,
    the start does not fail, one warning says why, and the cache holds no broken file."""
    limited = "import resource, signal\n" \
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n" \
              "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))\n"
    project, cache = _copy_project(tmp_path / "one"), tmp_path / "cache"
    result, output = _probe(project, cache, limited)
    assert result["uniq"] == [3, 5, 9]
    assert output.count("kernel cache not written") == 1, output
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix in (".nbi", ".nbc") or ".tmp." in p.name]
    second, _ = _probe(project, cache)  # with room again: compiled (nothing was kept) and saved
    assert (second["misses"], second["hits"]) == (1, 0)


def test_entries_of_another_cpu_are_not_loaded_but_compiled_beside_them(tmp_path):
    """numba keys each cached kernel by the CPU's name and features: a cache filled on another CPU (here the
    same one, named otherwise) is not loaded from; the kernel compiles, runs and is added."""
    other_cpu = "from numba.core import codegen\n" \
                "real = codegen.JITCPUCodegen.magic_tuple\n" \
                "codegen.JITCPUCodegen.magic_tuple = lambda self: (real(self)[0], 'another-cpu', '+other')\n"
    project, cache = _copy_project(tmp_path / "one"), tmp_path / "cache"
    filled, _ = _probe(project, cache, other_cpu)
    assert (filled["misses"], filled["hits"]) == (1, 0)
    here, _ = _probe(project, cache)
    assert here["uniq"] == [3, 5, 9] and (here["misses"], here["hits"]) == (1, 0)  # compiled, not loaded
    again, _ = _probe(project, cache)
    assert (again["misses"], again["hits"]) == (0, 1)  # this CPU's entry, added beside the other's


def test_the_build_is_every_kernel_file_and_nothing_else(tmp_path, monkeypatch):
    names = {str(p.relative_to(kernel_cache.PROJECT)) for p in kernel_cache.kernel_sources()}
    assert {"hybridrec/core/wire/dedup.py", "services/embedding_ps/kernels.py", "services/embedding_ps/row_storage.py",
            "services/embedding_ps/optimizers.py", "services/inference/byte_elements.py"} <= names
    assert "hybridrec/core/runtime/kernel_cache.py" not in names and "hybridrec/core/config/data.py" not in names


def test_old_builds_beyond_the_newest_few_are_removed(tmp_path):
    root = tmp_path / "kernels"
    for k in range(kernel_cache.BUILDS_KEPT + 3):
        old = root / f"{k:020d}"
        old.mkdir(parents=True)
        os.utime(old, (1_000_000 + k, 1_000_000 + k))
    (root / "not-a-build").mkdir()
    new = root / ("f" * 20)
    new.mkdir()
    kernel_cache._prune(root, keep=new)
    kept = sorted(p.name for p in root.iterdir())
    newest = [f"{k:020d}" for k in range(4, kernel_cache.BUILDS_KEPT + 3)]
    assert kept == sorted([*newest, "f" * 20, "not-a-build"])


RACE = """
import json, sys, time
from pathlib import Path
from hybridrec.core.wire import dedup
import numpy as np
here, other = Path(sys.argv[1]), Path(sys.argv[2])
here.touch()
while not other.exists():  # both processes call the kernel at once
    time.sleep(0.001)
dedup.unique_inverse(np.array([5, 3, 5, 9], np.uint64))
stats = dedup._unique_inverse.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
"""


def test_two_processes_that_miss_a_kernel_at_once_compile_it_once(tmp_path):
    """The second waits on the kernel's lock for the first one's compile and loads it (without the lock both
    would compile it, each missing the empty cache)."""
    project = _copy_project(tmp_path / "one")
    env = {**os.environ, "PYTHONPATH": str(project), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(ready[i]), str(ready[1 - i])], cwd=project, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert sorted((r["misses"], r["hits"]) for r in results) == [(0, 1), (1, 0)], results
    assert list((tmp_path / "cache").glob("*/locks/hybridrec.core.wire.dedup._unique_inverse.lock"))
