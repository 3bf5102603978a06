"""PS checkpoints: each shard dumps its rows as .npy files plus a manifest (docs/architecture.md#checkpoints).

On the embedding PS (and the `hybridrec checkpoint inspect` CLI). Layout:

    CKPT/ps/shard-00000-of-00002/manifest.json
                                 dim16.keys.npy     uint64 (n,)
                                 dim16.values.npy   float32 (n, dim + state width)
                                 dim16.touched.npy  int64 (n, 2): last update (store clock, unix ms),
                                                    with a TTL (ps.lifecycle)
                                 dim16.sketch.npy   uint8 (stripes, depth, columns): the admission
                                                    sketch, with admit_after > 1

The embedding lifecycle's state travels with the rows: each row's last
update (so a restored row expires when it would have), the store's clock (the
unit of step TTLs) and its admission sketch (so an ID counted before the
checkpoint does not start from zero). Sketches are merged by adding the
dumps' counters (they count disjoint shards' IDs), which never undercounts.

A shard is written into a hidden temporary directory and renamed into place,
so a crash mid-dump never leaves a half-written shard under its final name.
Loading reads the rows that belong to the loading shard from *all* shard
dumps, so a checkpoint taken with N shards restores into M shards. Every
manifest, size and sha256 is verified before the first row is inserted: a
corrupt, truncated or mismatched checkpoint is refused with nothing loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from hybridrec import checkpoints, log
from hybridrec.files import HashingWriter, fsync_dir
from services.embedding_ps.optimizers import state_width
from services.embedding_ps.store import EmbeddingStore

_log = log.get(__name__)

FORMAT_VERSION = 1
PS_SUBDIR = checkpoints.PS
MANIFEST = "manifest.json"
_SHARD_DIR = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
_CHUNK_BYTES = 16 << 20
_LIFECYCLE_PARTS = ("touched", "sketch")  # optional files of a table (older dumps have neither)


def shard_dir_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def _write_npy(path: Path, array: np.ndarray) -> dict:
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        np.lib.format.write_array(writer, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": writer.bytes, "sha256": writer.sha.hexdigest()}


def dump_shard(store_by_dim: dict[int, EmbeddingStore], directory: str | Path, *, shard: int, num_shards: int,
               step: int, life: int | None = None, applied: int | None = None) -> dict:
    """Write this shard's rows of every width under `directory`/ps/; returns the manifest.

    `life` and `applied`: the shard's life and the updates it had applied (services/embedding_ps/lives.py), so
    that a successor restoring this dump after a lost store knows what was lost after it.

    On the PS, from a worker thread: each store is copied under its stripe
    locks (a consistent snapshot per width), then written without locks.
    An existing dump of the same shard is replaced.
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    root = Path(directory) / PS_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    name = shard_dir_name(shard, num_shards)
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tables = {}
        for dim, store in sorted(store_by_dim.items()):
            config = store.config
            keys, values, touched = store.snapshot()
            sketch = store.sketch()
            tables[str(dim)] = {
                "dim": config.dim, "state_width": state_width(config.optimizer, config.dim),
                "optimizer": config.optimizer.model_dump(mode="json"), "num_rows": int(keys.shape[0]),
                "capacity": config.capacity, "seed": config.seed,
                "init": {"distribution": config.ps.init.distribution, "scale": config.ps.init.scale},
                "files": {"keys": _write_npy(tmp / f"dim{dim}.keys.npy", keys),
                          "values": _write_npy(tmp / f"dim{dim}.values.npy", values)},
                "clock": store.clock,
            }
            if touched is not None:
                tables[str(dim)]["files"]["touched"] = _write_npy(tmp / f"dim{dim}.touched.npy", touched)
            if sketch is not None:
                tables[str(dim)]["files"]["sketch"] = _write_npy(tmp / f"dim{dim}.sketch.npy", sketch)
        manifest = {"format_version": FORMAT_VERSION, "kind": "hybridrec-ps-shard", "shard": shard,
                    "num_shards": num_shards, "step": int(step), "created_unix": time.time(),
                    "widths": sorted(int(d) for d in store_by_dim), "tables": tables}
        if life is not None:
            manifest.update(life=int(life), applied=int(applied or 0))
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        final = root / name
        old = None
        if final.exists():  # rename() cannot replace a non-empty directory: move the old one aside first
            old = root / f".{name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log.info("ps shard checkpoint written", directory=str(final), step=step,
              rows={d: t["num_rows"] for d, t in tables.items()})
    return manifest


def _ps_root(directory: str | Path) -> Path:
    directory = Path(directory)
    root = directory / PS_SUBDIR if (directory / PS_SUBDIR).is_dir() else directory
    if not root.is_dir():
        raise ValueError(f"no PS checkpoint at {directory}: not a directory")
    return root


def _check_schema(path: Path, manifest) -> None:
    """ValueError unless the manifest has every field load_shard reads, with sane types."""
    def bad(what: str):
        return ValueError(f"{path}: malformed manifest ({what})")

    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ValueError(f"{path}: unsupported format_version {version!r} (expected {FORMAT_VERSION})")
    for field in ("shard", "num_shards", "step"):
        if not isinstance(manifest.get(field), int):
            raise bad(f"{field} is not an integer")
    if not isinstance(manifest.get("tables"), dict):
        raise bad("no tables")
    for width, table in manifest["tables"].items():
        if not isinstance(table, dict) or not all(isinstance(table.get(f), int)
                                                  for f in ("dim", "state_width", "num_rows")):
            raise bad(f"table {width}: dim/state_width/num_rows")
        if not isinstance(table.get("optimizer"), dict) or "name" not in table["optimizer"]:
            raise bad(f"table {width}: optimizer")
        if not isinstance(table.get("clock", 0), int):
            raise bad(f"table {width}: clock")
        files = table.get("files") if isinstance(table.get("files"), dict) else {}
        for part in ("keys", "values", *(p for p in _LIFECYCLE_PARTS if p in files)):
            entry = files.get(part)
            if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
                    or not isinstance(entry.get("sha256"), str) or not isinstance(entry.get("file"), str) \
                    or Path(entry["file"]).name != entry["file"]:
                raise bad(f"table {width}: files.{part}")


def _read_manifests(directory: str | Path) -> list[tuple[Path, dict]]:
    """(shard directory, manifest) of every shard dump, checked for a complete, coherent set."""
    root = _ps_root(directory)
    found = []
    for path in sorted(root.iterdir()):
        match = _SHARD_DIR.match(path.name)
        if not match or not path.is_dir():
            continue
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"unreadable manifest in {path}: {exc}") from exc
        _check_schema(path / MANIFEST, manifest)
        if (manifest["shard"], manifest["num_shards"]) != (int(match[1]), int(match[2])):
            raise ValueError(f"{path / MANIFEST} names shard {manifest.get('shard')} of "
                             f"{manifest.get('num_shards')}, but its directory is {path.name}")
        found.append((path, manifest))
    if not found:
        raise ValueError(f"no PS shard dumps (shard-NNNNN-of-NNNNN) under {root}")
    counts = {m["num_shards"] for _, m in found}
    if len(counts) != 1:
        raise ValueError(f"PS checkpoint {root} mixes dumps of {sorted(counts)} shards")
    num_shards = counts.pop()
    missing = sorted(set(range(num_shards)) - {m["shard"] for _, m in found})
    if missing:
        raise ValueError(f"PS checkpoint {root} is incomplete: shards {missing} of {num_shards} are missing")
    steps = {m["step"] for _, m in found}
    if len(steps) != 1:
        raise ValueError(f"PS checkpoint {root} mixes dumps of steps {sorted(steps)}")
    return found


def inspect_checkpoint(directory: str | Path) -> dict:
    """The manifests of a checkpoint's PS shards (no checksum verification: cheap)."""
    found = _read_manifests(directory)
    manifests = [m for _, m in found]
    return {"directory": str(_ps_root(directory)), "num_shards": manifests[0]["num_shards"],
            "step": manifests[0]["step"], "widths": manifests[0].get("widths"),
            "rows": {w: sum(m["tables"][w]["num_rows"] for m in manifests) for w in manifests[0]["tables"]},
            "shards": manifests}


def _verify_file(path: Path, entry: dict) -> None:
    size = path.stat().st_size if path.exists() else None
    if size != entry["bytes"]:
        raise ValueError(f"{path}: {'missing' if size is None else f'{size} bytes'}, manifest says "
                         f"{entry['bytes']} (truncated or replaced)")
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            sha.update(chunk)
    if sha.hexdigest() != entry["sha256"]:
        raise ValueError(f"{path}: sha256 mismatch (corrupt)")


def _open_table(path: Path, table: dict, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory-mapped (keys, values) of one verified table, their dtypes and shapes checked."""
    keys = np.load(path / table["files"]["keys"]["file"], mmap_mode="r", allow_pickle=False)
    values = np.load(path / table["files"]["values"]["file"], mmap_mode="r", allow_pickle=False)
    n, width = table["num_rows"], dim + table["state_width"]
    if keys.dtype != np.uint64 or keys.shape != (n,) or values.dtype != np.float32 or values.shape != (n, width):
        raise ValueError(f"{path} dim {dim}: arrays {keys.dtype}{keys.shape} / {values.dtype}{values.shape} do not "
                         f"match the manifest ({n} rows of width {width})")
    return keys, values


def _open_lifecycle(path: Path, table: dict, dim: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Memory-mapped (touched, sketch) of one verified table, None where the dump has none."""
    out = []
    for part, dtype in (("touched", np.int64), ("sketch", np.uint8)):
        entry = table["files"].get(part)
        array = None if entry is None else np.load(path / entry["file"], mmap_mode="r", allow_pickle=False)
        if array is not None and (array.dtype != dtype or (part == "touched" and array.shape != (table["num_rows"], 2))
                                  or (part == "sketch" and array.ndim != 3)):
            raise ValueError(f"{path} dim {dim}: {part} array {array.dtype}{array.shape} does not match the manifest")
        out.append(array)
    return out[0], out[1]


def load_shard(directory: str | Path, store_by_dim: dict[int, EmbeddingStore], *, shard: int, num_shards: int,
               shard_of: Callable[[np.ndarray], np.ndarray]) -> dict:
    """Insert into the stores the checkpoint rows that `shard_of` assigns to `shard` of `num_shards`.

    On the PS, from a worker thread. Reads every shard dump (only its own
    when the shard count is unchanged), verifies all of them first and raises
    ValueError with the reason, touching no store, if anything is off.
    Present rows with the same key are overwritten. Returns the step, rows loaded per width, the source shard
    count and `applied_by_life` (the updates each source shard's life had applied when it was dumped).
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    found = _read_manifests(directory)
    source_shards = found[0][1]["num_shards"]
    if source_shards == num_shards:  # same sharding: our rows are exactly those of our own dump
        found = [(p, m) for p, m in found if m["shard"] == shard]
    selected: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    for path, manifest in found:
        widths = {int(w) for w in manifest["tables"]}
        if widths != set(store_by_dim):
            raise ValueError(f"{path}: checkpoint has widths {sorted(widths)}, this PS has {sorted(store_by_dim)}")
        for dim, store in store_by_dim.items():
            table = manifest["tables"][str(dim)]
            spec, want_state = store.config.optimizer, state_width(store.config.optimizer, dim)
            if table["dim"] != dim or table["optimizer"]["name"] != spec.name or table["state_width"] != want_state:
                raise ValueError(f"{path} dim {dim}: checkpoint rows hold optimizer {table['optimizer']['name']} "
                                 f"state of width {table['state_width']}, the store uses {spec.name} ({want_state})")
            if table["optimizer"] != spec.model_dump(mode="json"):
                _log.warning("checkpoint optimizer hyper-parameters differ; using the configured ones",
                             dim=dim, checkpoint=table["optimizer"], configured=spec.model_dump(mode="json"))
            for part in ("keys", "values", *(p for p in _LIFECYCLE_PARTS if p in table["files"])):
                _verify_file(path / table["files"][part]["file"], table["files"][part])
            keys, values = _open_table(path, table, dim)
            touched, sketch = _open_lifecycle(path, table, dim)
            mine = np.flatnonzero(np.asarray(shard_of(np.asarray(keys))) == shard)
            if source_shards == num_shards and len(mine) != len(keys):
                raise ValueError(f"{path} dim {dim}: {len(keys) - len(mine)} rows do not belong to shard {shard} "
                                 "under the given shard function (was the checkpoint sharded differently?)")
            selected.append((dim, keys, values, mine, touched, sketch, table.get("clock", 0)))
    rows: dict[int, int] = {dim: 0 for dim in store_by_dim}
    clocks: dict[int, int] = {}
    for dim, *_, clock in selected:
        clocks[dim] = max(clocks.get(dim, 0), clock)
    for dim, clock in clocks.items():  # before the rows: their stamps are on the checkpoint's clock
        store_by_dim[dim].advance_clock(clock)
    for dim, keys, values, mine, touched, _, _ in selected:  # everything verified: now insert
        if len(mine):
            store_by_dim[dim].load_rows(np.ascontiguousarray(keys[mine]), np.ascontiguousarray(values[mine]),
                                        None if touched is None else np.ascontiguousarray(touched[mine]))
        rows[dim] += len(mine)
    for dim, store in store_by_dim.items():
        own = store.sketch()
        sketches = [np.asarray(sk) for d, *_, sk, _ in selected if d == dim and sk is not None]
        if own is not None and any(sk.shape != own.shape for sk in sketches):
            _log.warning("checkpoint sketch has another shape; admission counts start from zero", dim=dim,
                         checkpoint=[sk.shape for sk in sketches], store=own.shape)
        else:
            store.merge_sketch(sketches)
    for dim, n in rows.items():
        if n > store_by_dim[dim].config.capacity:
            _log.warning("checkpoint holds more rows than the store's capacity; the oldest were evicted",
                         dim=dim, rows=n, capacity=store_by_dim[dim].config.capacity)
    step = found[0][1]["step"]
    _log.info("ps shard checkpoint loaded", directory=str(directory), step=step, shard=shard,
              num_shards=num_shards, source_shards=source_shards, rows=rows)
    applied_by_life = {int(m["life"]): int(m["applied"]) for _, m in found if "life" in m}
    return {"step": step, "rows": rows, "source_shards": source_shards, "applied_by_life": applied_by_life}


def read_embeddings(directory: str | Path) -> tuple[dict, list[tuple[int, int, np.ndarray, np.ndarray]]]:
    """Every shard dump's trained rows, for export: (summary, [(shard, dim, keys, rows), ...]).

    Verifies every manifest, size and sha256 first (ValueError naming the file,
    as `load_shard` does) and that each dump holds only its own shard's IDs
    (`hybridrec.sharding.shard_of`). `rows` are the first `dim` columns of the
    memory-mapped values: the embeddings without optimizer state. `summary` is
    {"num_shards", "step", "widths"}.
    """
    from hybridrec.sharding import shard_of

    found = _read_manifests(directory)
    num_shards, step = found[0][1]["num_shards"], found[0][1]["step"]
    widths = sorted(int(w) for w in found[0][1]["tables"])
    out = []
    for path, manifest in found:
        if sorted(int(w) for w in manifest["tables"]) != widths:
            raise ValueError(f"{path / MANIFEST}: widths {sorted(manifest['tables'])} differ from the other shards' "
                             f"{widths}")
        for dim in widths:
            table = manifest["tables"][str(dim)]
            if table["dim"] != dim:
                raise ValueError(f"{path / MANIFEST}: table {dim} says dim {table['dim']}")
            for part in ("keys", "values"):
                _verify_file(path / table["files"][part]["file"], table["files"][part])
            keys, values = _open_table(path, table, dim)
            if keys.size and not np.all(shard_of(np.asarray(keys), num_shards) == manifest["shard"]):
                raise ValueError(f"{path / table['files']['keys']['file']}: holds IDs of other shards than "
                                 f"{manifest['shard']} of {num_shards}")
            out.append((manifest["shard"], dim, keys, values[:, :dim]))
    return {"num_shards": num_shards, "step": step, "widths": widths}, out
