"""Compiled numba kernels shipped in the container image, so that a fresh container loads them instead of
compiling them.

numba compiles a kernel on its first call and keeps the machine code in its cache directory
(`NUMBA_CACHE_DIR`); a container starts with an empty one (the image's root is read-only, the cache lives in the
container's /tmp), so every PS shard, embedding worker and data loader of a containerised cluster compiled the
same kernels again at every start: about half a minute of both cores for the compose cluster on the 2-vCPU
development machine, before anything trained.

The image build runs `python -m hybridrec.app.run.numba_seed` with `NUMBA_CACHE_DIR` pointing into the image
(`deploy/Dockerfile`): it calls every service's warm-up, which compiles its kernels into that directory. Each
`hybridrec` command then starts with `seed()`: when `HYBRIDREC_NUMBA_SEED` names that directory and the
container's `NUMBA_CACHE_DIR` does not exist yet, it is copied there (numba refuses a cache directory it cannot
write to, so the image's own copy cannot be used in place). A cached kernel is only taken for the same kernel
build (`hybridrec.core.runtime.kernel_cache`: the kernel files' content) and the same CPU, so on another CPU the copy is
ignored and the kernels compile as before.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SEED_ENV = "HYBRIDREC_NUMBA_SEED"
"""The directory of compiled kernels the image holds."""


def seed() -> bool:
    """Copy the image's compiled kernels into this container's empty `NUMBA_CACHE_DIR`; True when copied.

    Called first by every `hybridrec` command, before any kernel is loaded. A cache directory that exists is
    left alone (a command run earlier in the container copied it, or kernels were compiled there), and a copy
    that fails leaves numba to compile as without it. The copy is renamed into place whole, so a process that
    starts meanwhile (a health check) never sees half of it."""
    source, target = os.environ.get(SEED_ENV), os.environ.get("NUMBA_CACHE_DIR")
    if not source or not target or not os.path.isdir(source) or os.path.exists(target):
        return False
    target_path, staging = Path(target), None
    try:
        target_path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".numba-seed-", dir=target_path.parent))
        shutil.copytree(source, staging, dirs_exist_ok=True)
        os.rename(staging, target_path)
        return True
    except OSError:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        return False


def compile_all(scratch: Path) -> None:
    """Call every service's warm-up, compiling its kernels into `NUMBA_CACHE_DIR`: the data loader's parser and
    batch deduplication, the embedding worker's deduplication and gradient aggregation, the PS store's lookup,
    update and sweep (on a scratch table under `scratch`, for each layout whose kernels differ: a PS compiles
    only its own, `services.embedding_ps.row_storage.kernel_storage`; float32 rows with each optimizer and with
    admission's sketch), the NN worker's CPU pooling and progressive window, the
    inference service's table lookup, and the synthetic data writer's."""
    from hybridrec.core.model import bag_kernels, table_lookup
    from hybridrec.app.data.synth import synthesize
    from hybridrec.core.config import Config
    from services.dataloader import tsv
    from services.embedding_ps.server import warm_up as warm_up_ps
    from services.embedding_worker.server import warm_up as warm_up_embedding_worker
    from services.nn_worker import progressive

    tsv.warm_up()
    warm_up_embedding_worker()
    bag_kernels.warm_up()
    table_lookup.warm_up()
    progressive.warm_up()
    def ps(storage: str = "fp32", tier: dict | None = None, optimizer: str = "adagrad", **lifecycle) -> None:
        warm_up_ps(Config.model_validate({
            "data": {"train": ["unused.tsv"]}, "optimizer": {"embedding": {"name": optimizer}},
            "ps": {"shm_dir": str(scratch / "shm"), "capacity": 1024, "storage": storage, "tier": tier,
                   "lifecycle": lifecycle}}))

    for tier in (None, {"dir": str(scratch / "tier"), "capacity": 4096}):  # with and without a disk tier ...
        ps("fp32", tier)
        ps("fp16", tier, "rowwise_adagrad")  # ... float32 rows and 16-bit ones (one signature for fp16 and bf16)
    for optimizer in ("sgd", "adam", "ftrl", "rowwise_adagrad"):  # a store compiles its own optimizer only
        ps(optimizer=optimizer)
    ps(admit_after=2)  # a store that counts occurrences before it admits an ID (its sketch: another signature)
    synthesize(scratch / "synth", rows=100, eval_rows=100, seed=1)


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        compile_all(Path(scratch))
    cache = os.environ.get("NUMBA_CACHE_DIR", "")
    files = sum(len(names) for _, _, names in os.walk(cache)) if cache else 0
    print(f"numba kernels compiled into {cache or '(no NUMBA_CACHE_DIR)'}: {files} files")


if __name__ == "__main__":
    main()
