"""Layout of a job checkpoint, shared by the NN workers (who write it) and the data loader (who resumes from it).

    <checkpoint.dir>/step-00000120/
        manifest.json   written last: a directory without it is incomplete and ignored
        dense.pt        dense model and optimizer state (rank 0), loaded with weights_only=True
        config.yaml     the job's config (rank 0): what export and `hybridrec predict` rebuild the model from
        ps/shard-00000-of-00002/...   every PS shard's rows at the same step (services.embedding_ps.checkpoint)
    <checkpoint.dir>/ps-lives/shard-00000.json   each PS shard's lives in the job (services.embedding_ps.lives)

The names are spelled here only: the NN worker, the PS and export use these constants.

The manifest records the step, the training counters and, per data loader,
the data position right after the last batch of its stream the step consumed,
so every part of the job resumes from the same point.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridrec.core.runtime import log
from hybridrec.core.config import ConfigError
from hybridrec.core.layouts.files import fsync_dir, write_json_atomic

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DENSE = "dense.pt"
CONFIG = "config.yaml"
PS = "ps"
PS_LIVES = "ps-lives"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass
class JobManifest:
    step: int
    """Steps every NN worker had taken."""
    seq: int
    """Training batches consumed by all ranks together (of every data loader's stream; with one loader, the
    index it resumes with)."""
    position: list[int]
    """Data loader 0's position after its batch `loaders[0][0]` - 1: (epoch, file, byte offset, line)."""
    samples: int = 0
    train_wall_s: float = 0.0
    num_nn_workers: int = 1
    num_ps: int = 1
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)
    loaders: list = field(default_factory=list)
    """Per data loader (cluster.dataloader), [seq, position]: the batches of its stream consumed by all ranks
    together (it resumes with this index) and its position after them. Empty in a manifest of a hybridrec
    that had one data loader: then `seq` and `position` are that loader's."""
    chain: list = field(default_factory=list)
    """Steps of the older checkpoints whose PS dumps this one's build on (its shards' deltas, oldest first):
    `prune` keeps them while it keeps this one. Empty: every shard's dump is full."""
    files: dict = field(default_factory=dict)
    """Rank 0's files of the checkpoint (dense.pt, config.yaml): name -> {"bytes", "sha256"}, what `latest`
    verifies before a job resumes from it (the PS parts carry their own). Empty in a manifest of a hybridrec
    that recorded none: then nothing is verified."""

    def streams(self) -> list[tuple[int, list[int]]]:
        """(seq, position) of every data loader's stream, in loader order."""
        if not self.loaders:
            return [(self.seq, list(self.position))]
        return [(int(seq), [int(v) for v in position]) for seq, position in self.loaders]

    @classmethod
    def of_streams(cls, streams: list[tuple[int, list[int]]], **fields) -> "JobManifest":
        """A manifest of every loader's (seq, position); `seq` sums them, `position` is loader 0's."""
        return cls(seq=sum(seq for seq, _ in streams), position=list(streams[0][1]),
                   loaders=[[seq, list(position)] for seq, position in streams], **fields)


def check_loaders(path: Path, manifest: JobManifest, loaders: int) -> None:
    """A checkpoint resumes only with the number of data loaders that wrote it (each resumes its own split and
    stream); else ConfigError naming cluster.dataloader."""
    written = len(manifest.streams())
    if written != loaders:
        raise ConfigError(f"cluster.dataloader: checkpoint {path} was written by a job with {written} data "
                          f"loader{'s' if written != 1 else ''}, this one has {loaders}: each loader resumes "
                          f"its own split of the data; list {written} loaders, or start over in another "
                          f"checkpoint.dir")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def resolve_under(root: str | Path | None, name: str) -> Path:
    """`root/name` for a checkpoint named over the network, refused unless it stays inside `root`.

    A PS is told which checkpoint to write or load by name only: an empty or
    absolute name, a `..` segment, or a symlink that leads out of the root is
    a PermissionError (PERMISSION_DENIED to the caller), so no peer can make a
    service write or read files outside its configured checkpoint root.
    """
    if root is None:
        raise PermissionError("this service has no checkpoint root (checkpoint.dir is not set)")
    if not name or Path(name).is_absolute() or ".." in Path(name).parts or "\0" in name:
        raise PermissionError(f"checkpoint name {name!r} must be a relative path inside the checkpoint root")
    real_root = Path(root).resolve()
    target = (real_root / name).resolve()
    if target != real_root and real_root not in target.parents:
        raise PermissionError(f"checkpoint name {name!r} leads outside the checkpoint root")
    return target


def check_root(root: str | Path | None) -> None:
    """At start-up: the checkpoint root exists (created if missing) and is writable, else ValueError naming it."""
    if root is None:
        return
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"checkpoint.dir: cannot create {path}: {exc.strerror}") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint.dir: {path} is not a writable directory")


def complete(root: str | Path | None) -> list[Path]:
    """Every complete checkpoint under `root` (with its manifest), newest first: what a restore falls back
    along when the newest one's files are refused."""
    if root is None or not Path(root).is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)))
    return [path for _, path in reversed(steps) if (path / MANIFEST).is_file()]


def latest(root: str | Path | None) -> tuple[Path, JobManifest] | None:
    """The newest complete checkpoint under `root` that verifies, or None: its manifest reads, its chain
    (`JobManifest.chain`) is there too, and its files have the sizes and sha256 digests it records (a power
    loss can leave a renamed checkpoint whose dense.pt never reached the disk whole). One that does not is
    skipped, logged (`checkpoint_skipped`, naming it and why), and the one before it is tried."""
    if root is None or not Path(root).is_dir():
        return None
    for path in complete(root):
        try:
            manifest = read_manifest(path)
        except ValueError as exc:
            log.get().error("checkpoint_skipped", checkpoint=str(path), why=str(exc))
            continue
        missing = [step for step in manifest.chain if not (step_dir(root, step) / MANIFEST).is_file()]
        if missing:  # its PS deltas build on checkpoints that are gone: the one before may be whole
            log.get().error("checkpoint_chain_incomplete", checkpoint=str(path), missing_steps=missing)
            continue
        if (why := verify_files(path, manifest)) is not None:
            log.get().error("checkpoint_skipped", checkpoint=str(path), why=why)
            continue
        return path, manifest
    return None


def file_entry(path: Path) -> dict:
    """A file's {"bytes", "sha256"}, as a manifest records it (`JobManifest.files`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": digest.hexdigest()}


def verify_files(path: Path, manifest: JobManifest) -> str | None:
    """Why the files of the checkpoint at `path` are not those its manifest records, or None when they are."""
    for name, entry in manifest.files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        found = file_entry(file)
        if found["bytes"] != entry.get("bytes"):
            return f"{name} is {found['bytes']} bytes, the manifest says {entry.get('bytes')} (cut short)"
        if found["sha256"] != entry.get("sha256"):
            return f"{name}'s sha256 differs from the manifest's (its bytes changed)"
    return None


def seal(path: Path) -> None:
    """Make the checkpoint being written in `path` durable: every file in it (not the PS parts, which their
    shards write and fsync) and the directory itself fsynced, before its manifest is written and it is
    renamed into place."""
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def publish(tmp: Path, final: Path) -> None:
    """Rename the sealed checkpoint `tmp` (manifest written) to `final`, and fsync the root so the rename
    survives a power loss."""
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def resume_from(checkpoint_config) -> tuple[Path, JobManifest] | None:
    """The checkpoint a (re)started job resumes from, the same for NN workers and data loader.

    Only with interval checkpoints on (`interval_steps` or `interval_s`, and
    `resume`): a final checkpoint alone is for `hybridrec export`, so a job
    re-run into the same directory without an interval starts from the
    beginning in every service.
    """
    c = checkpoint_config
    if not (c.periodic and c.resume):
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
    ints = (manifest.step, manifest.seq, manifest.samples, manifest.num_nn_workers, manifest.num_ps)
    if not (isinstance(manifest.position, list) and len(manifest.position) == 4 and isinstance(manifest.loaders, list)
            and isinstance(manifest.chain, list) and all(isinstance(v, int) and v >= 0 for v in ints)):
        raise ValueError(f"checkpoint {path}: manifest fields out of range or of the wrong type")
    if not all(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and entry[0] >= 0
               and isinstance(entry[1], list) and len(entry[1]) == 4 for entry in manifest.loaders):
        raise ValueError(f"checkpoint {path}: loaders must be [seq, position] pairs, got {manifest.loaders!r}")
    if not isinstance(manifest.files, dict) or not all(
            isinstance(name, str) and "/" not in name and isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
            for name, entry in manifest.files.items()):
        raise ValueError(f"checkpoint {path}: files must map a file name to its bytes and sha256")
    return manifest


def write_manifest(path: Path, manifest: JobManifest) -> None:
    """Make `path` a complete checkpoint: the manifest goes last, through a temporary file and a rename."""
    write_json_atomic(path / MANIFEST, asdict(manifest), fsync=True)


def prune(root: str | Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` checkpoints and those their PS dumps build on (`JobManifest.chain`);
    incomplete ones older than them go too. Returns the steps deleted.

    This is how an incremental chain is compacted: once a newer full dump is among the kept checkpoints, the
    old chain's full dump and deltas are needed by none of them and go."""
    steps = sorted((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)))
    kept = steps[-keep:] if keep else []
    needed = {step for step, _ in kept}
    for _, path in kept:
        if (path / MANIFEST).is_file():
            needed.update(int(step) for step in read_manifest(path).chain)
    deleted = []
    for step, path in steps:
        if step not in needed:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(step)
    return deleted
