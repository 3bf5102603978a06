"""Run one coverage-guided fuzz target (tests/fuzz/targets.py) under atheris, libFuzzer's engine for Python.

    python -m tests.fuzz.run TARGET [libFuzzer flags, e.g. -max_total_time=30 -runs=1000000]
    python -m tests.fuzz.run --write-seeds        # tests/fuzz/corpus/<target>/ from each target's seeds

hybridrec's and services' modules are instrumented for coverage as they are imported here (the numba kernels,
torch and pyarrow are imported before, left alone: compiled code, not Python's). The run starts from the
target's seed corpus in the repository and writes what it finds to a corpus of its own (`--work DIR`, default
a temporary directory): the repository's is only read. It exits 0 when nothing but the target's own error
type escaped within libFuzzer's memory limit (`RSS_LIMIT_MB`, over inputs of at most `targets.MAX_LEN`
bytes), and prints libFuzzer's figures (executions, coverage, peak RSS).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
RSS_LIMIT_MB = 2048
"""Peak RSS a fuzzed process may reach (libFuzzer's -rss_limit_mb): the interpreter, torch and pyarrow take
about 600 MB before the first input, so a decoder may take under 1.4 GB for an input of at most 1 MiB."""
INSTRUMENTED = ("hybridrec.core.wire.codec", "hybridrec.core.wire.frames", "hybridrec.core.wire.arrow_ipc",
                "hybridrec.core.layouts.event_stream", "hybridrec.core.layouts.slot_layouts",
                "hybridrec.core.wire.jagged", "hybridrec.core.wire.compress", "hybridrec.core.layouts.bundle",
                "hybridrec.core.layouts.checkpoints", "services.dataloader.columns", "services.dataloader.stream",
                "services.dataloader.tsv", "services.dataloader.prepared", "services.inference.rest",
                "services.inference.grpc_api", "services.inference.inputs")
"""The modules whose Python code the fuzzer follows (the decoders and what they call). Modules that define numba
kernels are not among them: numba compiles a function from its bytecode, which the instrumentation changes."""
KERNELS = ("hybridrec.core.layouts.criteo_kernels", "hybridrec.core.wire.dedup", "services.inference.byte_elements")
"""Imported before the instrumentation, so that their kernels keep their own bytecode."""


def write_seeds() -> None:
    from tests.fuzz.targets import RUNS, target

    for name in RUNS:
        folder = CORPUS / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for i, seed in enumerate(target(name).seeds()):
            (folder / f"seed-{i:02d}").write_bytes(seed)


def main(argv: list[str]) -> None:
    if argv[1:] == ["--write-seeds"]:
        write_seeds()
        return
    import atheris

    name, flags = argv[1], [a for a in argv[2:] if not a.startswith("--work=")]
    work = next((Path(a.split("=", 1)[1]) for a in argv[2:] if a.startswith("--work=")), None)
    work = work or Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    import numba  # noqa: F401 - compiled code and large libraries: imported before the instrumentation
    import pyarrow  # noqa: F401
    import torch  # noqa: F401

    for module in KERNELS:
        __import__(module)
    with atheris.instrument_imports(include=list(INSTRUMENTED)):
        for module in INSTRUMENTED:
            __import__(module)
    from tests.fuzz.targets import MAX_LEN, target

    fuzzed = target(name)

    def one(data: bytes) -> None:
        try:
            fuzzed.run(data)
        except fuzzed.expected:
            pass

    atheris.Setup([argv[0], f"-max_len={MAX_LEN}", f"-rss_limit_mb={RSS_LIMIT_MB}", f"-artifact_prefix={work}/",
                   *flags, str(work), str(CORPUS / name)], one)
    atheris.Fuzz()


def fresh_process(run) -> int:
    """`run()` in a forked child, its exit status returned. Linux carries a process's peak RSS (ru_maxrss,
    what libFuzzer's -rss_limit_mb reads) across exec: a fuzzer started by a test process that once held
    gigabytes would be out of memory from its first input. A forked child starts its count afresh."""
    pid = os.fork()
    if pid == 0:
        try:
            run()
        except SystemExit as exc:
            os._exit(exc.code if isinstance(exc.code, int) else 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    code = fresh_process(lambda: main(sys.argv))
    sys.exit(code if code >= 0 else 128 - code)
