"""Layout of a job checkpoint, shared by the NN workers (who write it) and the data loader (who resumes from it).

    <checkpoint.dir>/step-00000120/
        manifest.json   written last: a directory without it is incomplete and ignored
        dense.pt        dense model and optimizer state (rank 0), loaded with weights_only=True
        ps/shard-00000-of-00002/...   every PS shard's rows at the same step (services.embedding_ps.checkpoint)

The manifest records the step, the training counters and the data position
right after the last batch the step consumed, so every part of the job resumes
from the same point.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass
class JobManifest:
    step: int
    """Steps every NN worker had taken."""
    seq: int
    """Training batches consumed by all ranks together; the data loader resumes with this batch index."""
    position: list[int]
    """Data position after batch seq - 1: (epoch, file, byte offset, line)."""
    samples: int = 0
    train_wall_s: float = 0.0
    num_nn_workers: int = 1
    num_ps: int = 1
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def latest(root: str | Path | None) -> tuple[Path, JobManifest] | None:
    """The newest complete checkpoint under `root`, or None. A malformed manifest is an error, not skipped."""
    if root is None or not Path(root).is_dir():
        return None
    steps = sorted((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, path in reversed(steps):
        if (path / MANIFEST).is_file():
            return path, read_manifest(path)
    return None


def resume_from(checkpoint_config) -> tuple[Path, JobManifest] | None:
    """The checkpoint a (re)started job resumes from, the same for NN workers and data loader.

    Only with interval checkpoints on (`interval_steps` and `resume`): a final
    checkpoint alone is for `hybridrec export`, so a job re-run into the same
    directory without an interval starts from the beginning in every service.
    """
    c = checkpoint_config
    if not (c.dir and c.interval_steps and c.resume):
        return None
    return latest(c.dir)


def read_manifest(path: Path) -> JobManifest:
    try:
        raw = json.loads((path / MANIFEST).read_text())
        manifest = JobManifest(**raw)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"checkpoint {path}: unreadable manifest: {exc}") from None
    if manifest.format_version != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path}: format_version {manifest.format_version}, expected {FORMAT_VERSION}")
    if len(manifest.position) != 4 or manifest.step < 0 or manifest.seq < 0:
        raise ValueError(f"checkpoint {path}: manifest fields out of range")
    return manifest


def write_manifest(path: Path, manifest: JobManifest) -> None:
    """Make `path` a complete checkpoint: the manifest goes last, through a temporary file and a rename."""
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(manifest), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (and any incomplete ones older than them)."""
    steps = sorted((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, path in steps[:-keep] if keep else steps:
        shutil.rmtree(path, ignore_errors=True)
