"""PS checkpoints: each shard streams its rows into .npy parts plus a manifest; full dumps and deltas
(docs/architecture.md#checkpoints).

On the embedding PS (and the `hybridrec checkpoint inspect` CLI, and export). Layout of one dump:

    CKPT/ps/shard-00000-of-00002/manifest.json
                                 dim16.00000.keys.npy     uint64 (n,)          a part: at most CHUNK_BYTES
                                 dim16.00000.values.npy   float32 (n, dim + state width)
                                 dim16.00000.touched.npy  int64 (n, 2): last update (store clock, unix ms),
                                                          with a TTL (ps.lifecycle)
                                 dim16.00001.keys.npy ...
                                 dim16.sketch.npy         uint8 (stripes, depth, columns): the admission
                                                          sketch, with admit_after > 1

Streaming. A dump never copies a table: `EmbeddingStore.stream_rows` hands
out one chunk of rows at a time, copied from one stripe in batches without its
lock (a batch that a request overlapped is copied again), and the chunk is
written (and hashed) before the next is copied. The extra memory is one chunk
plus a stripe's LRU links (`dump_memory_bytes`), whatever the table's size,
and no lookup or update waits for the dump. Shards dump independently, each
when asked.

Consistency. Every update the shard applied before the dump began is in it;
an update applied while it runs is in it or in the next dump, row by row (each
row is copied whole). The job's checkpoint protocol drains every gradient push
before it asks the shards to dump, so a dump holds exactly the updates of the
batches trained up to its step, plus rows that lookups of later batches
inserted meanwhile (harmless: as a restart keeps them, services/nn_worker/checkpoint.py).
`applied` in the manifest is counted before the first row is copied: a lost
store's successor counts what the shard applied after it as lost (lives.py),
at worst a few updates that the dump did hold.

Increments. A store marks each row it inserts or updates (`EmbeddingStore.stream_rows`
clears the marks of the rows it copies), so a dump can hold only the rows
changed since the shard's previous dump: a delta. `chain` in the manifest
lists the steps whose dumps make up this one's rows, oldest first: a full dump,
then deltas, then this one; every file is listed with its size and sha256.
A shard writes a delta when the job names the previous checkpoint (`base`),
this shard's stores dumped into it and know every change since (a restarted
process knows none: its first dump is full), the chain is shorter than
`checkpoint.full_every` and fewer than half the live rows changed; else a full
dump, which starts a new chain (old chains go when no kept checkpoint needs
them, `hybridrec.core.layouts.checkpoints.prune`). Not in a delta: rows removed since
(evicted, expired): a restore brings such a row back with its last trained
value, and the store's LRU or TTL removes it again as it would any row.

A shard is written into a hidden temporary directory and renamed into place,
so a crash mid-dump never leaves a half-written shard under its final name.
Loading reads the rows that belong to the loading shard from *all* shard
dumps and their chains, part by part (memory bounded by a part), so a
checkpoint taken with N shards restores into M shards. Every manifest of every
chain, every size and sha256, is verified before the first row is inserted: a
corrupt, truncated, missing or mismatched file is refused naming it, with
nothing loaded. Dumps of format 1 (one keys/values file per table) still load.
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
from typing import Callable, Iterator

import numpy as np

from hybridrec.core.layouts import checkpoints
from hybridrec.core.runtime import log
from hybridrec.core.layouts.files import HashingWriter, fsync_dir
from services.embedding_ps import row_storage as R
from services.embedding_ps.optimizers import state_width
from services.embedding_ps.store import EmbeddingStore, StoreConfig

_log = log.get(__name__)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""1: one keys/values(/touched/sketch) file per table, always full."""
PS_SUBDIR = checkpoints.PS
MANIFEST = "manifest.json"
_SHARD_DIR = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
_CHUNK_BYTES = 16 << 20  # read size when hashing
CHUNK_BYTES = 64 << 20
"""A dump's part: rows copied and written together (the dump's buffer)."""
COPY_ROWS = 1 << 13
"""Rows a dump copies at once from a stripe (without its lock: `EmbeddingStore.stream_rows`). A copy that a
request overlapped is taken again, so shorter copies are discarded less often."""
_PART_FILES = ("keys", "values", "touched")  # touched: only with a TTL


def shard_dir_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def row_bytes(config: StoreConfig) -> int:
    """Bytes one row of a store of `config` takes in a dump's parts: key, values and state, last update with
    a TTL."""
    return 8 + 4 * config.row_width + (16 if config.uses_ttl else 0)


def dump_memory_bytes(config: StoreConfig, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The most memory a dump of a store of `config` adds to its PS: the chunk buffers, plus a stripe's copied
    links, LRU order and changed subset (4 bytes each per slot) and a mark test (1 byte per slot). What
    `hybridrec plan` counts for checkpoints."""
    stripe_slots = -(-config.capacity // config.num_stripes)
    return _chunk_rows(config, chunk_bytes) * row_bytes(config) + 13 * stripe_slots


def _chunk_rows(config: StoreConfig, chunk_bytes: int) -> int:
    """Rows of one dump part (at least one)."""
    return max(1, chunk_bytes // row_bytes(config))


def dump_bytes(manifest: dict) -> int:
    """Bytes of a dump's row files (its parts and sketches; the manifest aside)."""
    return sum(e["bytes"] for t in manifest["tables"].values() for e in _table_files(t))


def _write_npy(path: Path, array: np.ndarray) -> dict:
    """An .npy file of `array`, written and hashed from the array's own memory (numpy's `write_array` copies
    a file-like target's data in 16 MiB pieces first)."""
    array = np.ascontiguousarray(array)  # a chunk's rows are contiguous already: no copy
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        np.lib.format.write_array_header_1_0(writer, np.lib.format.header_data_from_array_1_0(array))
        writer.write(memoryview(array).cast("B"))
        f.flush()
        os.fsync(f.fileno())
        # Written and durable: drop it from the page cache. A dump of a large table would otherwise fill the
        # host's memory with cache the PS never reads again, and the kernel would reclaim it from under
        # everything else (measured at 100M rows: lookups stalled up to 350 ms, a restarted process re-read
        # its libraries from disk).
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return {"file": path.name, "bytes": writer.bytes, "sha256": writer.sha.hexdigest()}


def _dump_table(store: EmbeddingStore, into: Path, *, delta: bool, chunk_bytes: int) -> dict:
    """Stream one store's rows (all, or those changed since its last dump) into part files; the table's entry."""
    config, dim = store.config, store.config.dim
    parts, rows = [], 0
    chunk_rows = _chunk_rows(config, chunk_bytes)
    for i, (keys, values, touched) in enumerate(store.stream_rows(changed_only=delta, chunk_rows=chunk_rows,
                                                                   batch_rows=COPY_ROWS)):
        part = {"rows": int(keys.shape[0]), "keys": _write_npy(into / f"dim{dim}.{i:05d}.keys.npy", keys),
                "values": _write_npy(into / f"dim{dim}.{i:05d}.values.npy", values)}
        if touched is not None:
            part["touched"] = _write_npy(into / f"dim{dim}.{i:05d}.touched.npy", touched)
        parts.append(part)
        rows += part["rows"]
    table = {"dim": dim, "state_width": state_width(config.optimizer, dim), "storage": str(config.ps.storage),
             "optimizer": config.optimizer.model_dump(mode="json"), "num_rows": rows,
             "capacity": config.capacity, "seed": config.seed,
             "init": {"distribution": config.ps.init.distribution, "scale": config.ps.init.scale},
             "clock": store.clock, "parts": parts}
    sketch = store.sketch()
    if sketch is not None:
        table["sketch"] = _write_npy(into / f"dim{dim}.sketch.npy", sketch)
    return table


def _chain_before(job_root: Path, name: str, store_by_dim: dict[int, EmbeddingStore], base: int | None,
                  step: int, full_every: int) -> list[int]:
    """The chain a delta on checkpoint `base` continues ([]: this dump must be full; see the module's
    docstring for when). A dump of the base's own step (a final checkpoint of the step an interval one
    wrote) is full: it replaces the directory a delta would build on."""
    if base is None or base >= step or full_every <= 1 \
            or any(store.dumped != base for store in store_by_dim.values()):
        return []
    path = checkpoints.step_dir(job_root, base) / PS_SUBDIR / name
    try:
        manifest = _normalized(path / MANIFEST, json.loads((path / MANIFEST).read_text()))
    except (OSError, ValueError) as exc:
        _log.warning("ps_checkpoint_base_unreadable", directory=str(path), error=str(exc), writes="a full dump")
        return []
    if manifest["step"] != base or len(manifest["chain"]) >= full_every:
        return []
    changed = sum(store.changed_rows() for store in store_by_dim.values())
    if 2 * changed > sum(store.table_rows for store in store_by_dim.values()):
        return []  # a delta of over half the table: a full dump restores faster and costs about as much
    return list(manifest["chain"])


def dump_shard(store_by_dim: dict[int, EmbeddingStore], directory: str | Path, *, shard: int, num_shards: int,
               step: int, life: int | None = None, applied: int | None = None, base: int | None = None,
               full_every: int = 1, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Write this shard's rows of every width under `directory`/ps/, streamed; returns the manifest.

    `directory` is a job checkpoint (`<checkpoint.dir>/step-N`, or its staging directory beside it). `base`:
    the step of the job's previous complete checkpoint, which a delta builds on (None: full); `full_every`:
    the longest chain (checkpoint.full_every). `life` and `applied`: the shard's life and the updates it had
    applied (services/embedding_ps/lives.py), so that a successor restoring this dump after a lost store knows
    what was lost after it.

    On the PS, from a worker thread, while the shard keeps serving. An existing dump of the same shard is
    replaced.
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    root = Path(directory) / PS_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    name = shard_dir_name(shard, num_shards)
    chain = [*_chain_before(Path(directory).parent, name, store_by_dim, base, int(step), full_every), int(step)]
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    started = time.monotonic()
    try:
        tables = {str(dim): _dump_table(store, tmp, delta=len(chain) > 1, chunk_bytes=chunk_bytes)
                  for dim, store in sorted(store_by_dim.items())}
        manifest = {"format_version": FORMAT_VERSION, "kind": "hybridrec-ps-shard", "shard": shard,
                    "num_shards": num_shards, "step": int(step), "created_unix": time.time(),
                    "widths": sorted(int(d) for d in store_by_dim), "delta": len(chain) > 1, "chain": chain,
                    "tables": tables}
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
        for store in store_by_dim.values():  # marks of copied rows are gone with the dump: the next is full
            store.dumped = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for store in store_by_dim.values():
        store.dumped = int(step)
    _log.info("ps shard checkpoint written", directory=str(final), step=step, delta=manifest["delta"],
              chain=chain, seconds=round(time.monotonic() - started, 3),
              rows={d: t["num_rows"] for d, t in tables.items()}, bytes=dump_bytes(manifest),
              longest_lock_hold_ms=round(max(s.longest_hold_s for s in store_by_dim.values()) * 1e3, 2),
              copies={k: sum(s.dump_copies[k] for s in store_by_dim.values()) for k in ("copies", "retries", "locked")})
    return manifest


def _ps_root(directory: str | Path) -> Path:
    directory = Path(directory)
    root = directory / PS_SUBDIR if (directory / PS_SUBDIR).is_dir() else directory
    if not root.is_dir():
        raise ValueError(f"no PS checkpoint at {directory}: not a directory")
    return root


def _files_of(part: dict) -> list[dict]:
    """The file entries of one part of a table."""
    return [part[name] for name in _PART_FILES if name in part]


def _table_files(table: dict) -> list[dict]:
    """The file entries of a table in a dump: every part's, then its sketch's if it has one."""
    return [f for p in table["parts"] for f in _files_of(p)] + ([table["sketch"]] if "sketch" in table else [])


def _check_entry(entry, where: str, bad) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
            or not isinstance(entry.get("sha256"), str) or not isinstance(entry.get("file"), str) \
            or Path(entry["file"]).name != entry["file"]:
        raise bad(where)


def _normalized(path: Path, manifest) -> dict:
    """The manifest with every field loading reads checked (ValueError naming `path` otherwise), a format-1
    manifest in format 2's shape: one part per table, a chain of itself."""
    def bad(what: str):
        return ValueError(f"{path}: malformed manifest ({what})")

    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{path}: unsupported format_version {version!r} (expected one of {READABLE_VERSIONS})")
    for field in ("shard", "num_shards", "step"):
        if not isinstance(manifest.get(field), int):
            raise bad(f"{field} is not an integer")
    if not isinstance(manifest.get("tables"), dict):
        raise bad("no tables")
    out = dict(manifest, tables={})
    if version == 1:
        out.update(delta=False, chain=[manifest["step"]])
    chain = out.get("chain")
    if not isinstance(chain, list) or not chain or not all(isinstance(c, int) for c in chain) \
            or chain[-1] != manifest["step"] or any(a >= b for a, b in zip(chain, chain[1:])) \
            or out.get("delta") is not (len(chain) > 1):
        raise bad("chain: increasing steps ending with this one; delta when longer than one")
    for width, table in manifest["tables"].items():
        if not isinstance(table, dict) or not all(isinstance(table.get(f), int)
                                                  for f in ("dim", "state_width", "num_rows")):
            raise bad(f"table {width}: dim/state_width/num_rows")
        if not isinstance(table.get("optimizer"), dict) or "name" not in table["optimizer"]:
            raise bad(f"table {width}: optimizer")
        if not isinstance(table.get("clock", 0), int):
            raise bad(f"table {width}: clock")
        if table.get("storage", "fp32") not in STORAGE_BY_NAME:
            raise bad(f"table {width}: storage {table.get('storage')!r} (known: {', '.join(STORAGE_BY_NAME)})")
        table = dict(table)
        if version == 1:
            files = table.get("files") if isinstance(table.get("files"), dict) else {}
            table["parts"] = [{"rows": table["num_rows"], "keys": files.get("keys"), "values": files.get("values"),
                               **({"touched": files["touched"]} if "touched" in files else {})}]
            if "sketch" in files:
                table["sketch"] = files["sketch"]
        parts = table.get("parts")
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("rows"), int)
                                                  for p in parts):
            raise bad(f"table {width}: parts")
        for i, part in enumerate(parts):
            for name in ("keys", "values", *(["touched"] if "touched" in part else [])):
                _check_entry(part.get(name), f"table {width}: part {i} {name}", bad)
        if "sketch" in table:
            _check_entry(table["sketch"], f"table {width}: sketch", bad)
        if sum(p["rows"] for p in parts) != table["num_rows"]:
            raise bad(f"table {width}: its parts' rows ({sum(p['rows'] for p in parts)}) do not match num_rows "
                      f"({table['num_rows']})")
        out["tables"][width] = table
    return out


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
        manifest = _normalized(path / MANIFEST, manifest)
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


def _chain_of(path: Path, manifest: dict) -> list[tuple[Path, dict]]:
    """The dumps whose rows make up the dump at `path`, oldest (a full dump) first, itself last; ValueError
    naming the first one missing, unreadable or not of this chain. Its members lie beside it in the job's
    other checkpoints: `<checkpoint.dir>/step-N/ps/<this shard's directory name>`."""
    chain = manifest["chain"]
    members = []
    for i, step in enumerate(chain[:-1]):
        member = checkpoints.step_dir(path.parent.parent.parent, step) / PS_SUBDIR / path.name
        try:
            raw = json.loads((member / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{member / MANIFEST}: missing or unreadable, and the dump {path} builds on it "
                             f"(chain {chain}): {exc}") from None
        found = _normalized(member / MANIFEST, raw)
        if found["step"] != step or found["chain"] != chain[:i + 1] \
                or (found["shard"], found["num_shards"]) != (manifest["shard"], manifest["num_shards"]):
            raise ValueError(f"{member / MANIFEST}: step {found['step']} chain {found['chain']}, not step {step} of "
                             f"the chain {chain} that {path} builds on")
        members.append((member, found))
    return [*members, (path, manifest)]


def inspect_checkpoint(directory: str | Path) -> dict:
    """The manifests of a checkpoint's PS shards (no checksum verification: cheap). `rows`: the rows these
    dumps hold (a delta's: the changed ones)."""
    found = _read_manifests(directory)
    manifests = [m for _, m in found]
    return {"directory": str(_ps_root(directory)), "num_shards": manifests[0]["num_shards"],
            "step": manifests[0]["step"], "widths": manifests[0].get("widths"),
            "rows": {w: sum(m["tables"][w]["num_rows"] for m in manifests) for w in manifests[0]["tables"]},
            "chains": {m["shard"]: m["chain"] for m in manifests}, "shards": manifests}


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


def _open_part(path: Path, part: dict, dim: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Memory-mapped (keys, values, touched or None) of one verified part, dtypes and shapes checked."""
    keys = np.load(path / part["keys"]["file"], mmap_mode="r", allow_pickle=False)
    values = np.load(path / part["values"]["file"], mmap_mode="r", allow_pickle=False)
    n = part["rows"]
    if keys.dtype != np.uint64 or keys.shape != (n,) or values.dtype != np.float32 or values.shape != (n, width):
        raise ValueError(f"{path} dim {dim}: arrays {keys.dtype}{keys.shape} / {values.dtype}{values.shape} do not "
                         f"match the manifest ({n} rows of width {width})")
    touched = None
    if "touched" in part:
        touched = np.load(path / part["touched"]["file"], mmap_mode="r", allow_pickle=False)
        if touched.dtype != np.int64 or touched.shape != (n, 2):
            raise ValueError(f"{path} dim {dim}: touched array {touched.dtype}{touched.shape} does not match the "
                             "manifest")
    return keys, values, touched


def _open_sketch(path: Path, table: dict, dim: int) -> np.ndarray | None:
    if "sketch" not in table:
        return None
    sketch = np.load(path / table["sketch"]["file"], mmap_mode="r", allow_pickle=False)
    if sketch.dtype != np.uint8 or sketch.ndim != 3:
        raise ValueError(f"{path} dim {dim}: sketch array {sketch.dtype}{sketch.shape} does not match the manifest")
    return sketch


STORAGE_BY_NAME = {name: code for code, name in R.STORAGE_NAMES.items()}
"""A table's `storage` in a manifest (absent before compact rows: fp32) -> row_storage code."""
CONVERTIBLE_STATES = {("adagrad", "rowwise_adagrad")}
"""Optimizer changes a restore converts the state of (source, store); any other change is refused. Adagrad's
per-weight sums become row-wise Adagrad's one sum by their mean over the row (the row-wise sum accumulates
the mean squared gradient, of which the per-weight sums are the parts)."""


def storage_of(table: dict) -> int:
    """The row_storage code of a manifest's table."""
    return STORAGE_BY_NAME[table.get("storage", "fp32")]


def table_row_width(table: dict) -> int:
    """float32 words per row in a table's parts: its weights as stored, then its optimizer state."""
    return R.weight_words(table["dim"], storage_of(table)) + table["state_width"]


def _layout_name(optimizer: str, storage: str) -> str:
    return f"{optimizer} rows of {storage} weights"


def _converted(values: np.ndarray, table: dict, config: StoreConfig) -> np.ndarray:
    """A part's rows in the store's layout: weights re-encoded (to nearest) when the storage differs, row-wise
    sums from per-weight ones (CONVERTIBLE_STATES); the rows themselves when nothing differs."""
    source, dim = storage_of(table), table["dim"]
    same_state = table["optimizer"]["name"] == config.optimizer.name
    if source == config.storage_code and same_state:
        return values
    state = np.asarray(values[:, R.weight_words(dim, source):])
    if not same_state:
        state = state.mean(axis=1, keepdims=True, dtype=np.float32)
    weights = R.encode_weights(R.decode_weights(np.asarray(values), dim, source), config.storage_code)
    return np.ascontiguousarray(np.hstack([weights, state]), np.float32)


def _parts(chain: list[tuple[Path, dict]], dim: int) -> Iterator[tuple[Path, dict, dict]]:
    """(dump directory, table, part) of width `dim` along a chain, oldest first."""
    for path, manifest in chain:
        table = manifest["tables"][str(dim)]
        for part in table["parts"]:
            yield path, table, part


def _check_chain(chain: list[tuple[Path, dict]], store_by_dim: dict[int, EmbeddingStore], *, shard: int,
                 own: bool, shard_of: Callable[[np.ndarray], np.ndarray]) -> None:
    """Verify every dump of a chain against the stores, every file's size and sha256 and, for a shard's own
    chain (`own`), that it holds only that shard's IDs; ValueError naming the file, before anything loads."""
    for path, manifest in chain:
        widths = {int(w) for w in manifest["tables"]}
        if widths != set(store_by_dim):
            raise ValueError(f"{path}: checkpoint has widths {sorted(widths)}, this PS has {sorted(store_by_dim)}")
        for dim, store in store_by_dim.items():
            table = manifest["tables"][str(dim)]
            spec, want_state = store.config.optimizer, state_width(store.config.optimizer, dim)
            names = (table["optimizer"]["name"], str(spec.name))
            same_state = names[0] == names[1] and table["state_width"] == want_state
            if table["dim"] != dim or not (same_state or names in CONVERTIBLE_STATES):
                raise ValueError(f"{path} dim {dim}: checkpoint holds {_layout_name(names[0], table.get('storage', 'fp32'))} (state of width "
                                 f"{table['state_width']}), the store {_layout_name(names[1], str(store.config.ps.storage))} ({want_state}); "
                                 "no conversion between these optimizers (optimizer.embedding.name)")
            if table["optimizer"] != spec.model_dump(mode="json"):
                _log.warning("checkpoint optimizer hyper-parameters differ; using the configured ones",
                             dim=dim, checkpoint=table["optimizer"], configured=spec.model_dump(mode="json"))
            for entry in _table_files(table):
                _verify_file(path / entry["file"], entry)
            _open_sketch(path, table, dim)
            for part in table["parts"]:
                keys, _, _ = _open_part(path, part, dim, table_row_width(table))
                stray = len(keys) - int(np.count_nonzero(np.asarray(shard_of(np.asarray(keys))) == shard))
                if own and stray:
                    raise ValueError(f"{path} dim {dim}: {stray} rows do not belong to shard {shard} under the "
                                     "given shard function (was the checkpoint sharded differently?)")


def load_shard(directory: str | Path, store_by_dim: dict[int, EmbeddingStore], *, shard: int, num_shards: int,
               shard_of: Callable[[np.ndarray], np.ndarray]) -> dict:
    """Insert into the stores the checkpoint rows that `shard_of` assigns to `shard` of `num_shards`.

    On the PS, from a worker thread. Reads every shard dump and its chain (only its own when the shard count
    is unchanged), verifies all of them first and raises ValueError with the reason, touching no store, if
    anything is off; then inserts part by part, each chain oldest first, so a row ends as its newest dump
    has it. Present rows with the same key are overwritten. Returns the step, rows read per width (a row in
    several dumps of a chain counts each time), the source shard count and `applied_by_life` (the updates
    each source shard's life had applied when it was dumped).
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    found = _read_manifests(directory)
    source_shards = found[0][1]["num_shards"]
    own = source_shards == num_shards
    if own:  # same sharding: our rows are exactly those of our own dump
        found = [(p, m) for p, m in found if m["shard"] == shard]
    chains = [_chain_of(path, manifest) for path, manifest in found]
    for chain in chains:
        _check_chain(chain, store_by_dim, shard=shard, own=own, shard_of=shard_of)
    for dim, store in store_by_dim.items():  # before the rows: their stamps are on the checkpoint's clock
        store.advance_clock(max(chain[-1][1]["tables"][str(dim)].get("clock", 0) for chain in chains))
    rows: dict[int, int] = {dim: 0 for dim in store_by_dim}
    evictions = {dim: store.stats()["evictions"] for dim, store in store_by_dim.items()}
    for chain in chains:  # everything verified: now insert
        for dim, store in store_by_dim.items():
            for path, table, part in _parts(chain, dim):
                keys, values, touched = _open_part(path, part, dim, table_row_width(table))
                values = _converted(values, table, store.config)
                mine = slice(None) if own else np.flatnonzero(np.asarray(shard_of(np.asarray(keys))) == shard)
                keys = np.ascontiguousarray(keys[mine])
                if len(keys) and store.tier is not None:  # onto disk in file order; memory warms as it trains
                    store.load_cold(keys, np.ascontiguousarray(values[mine]))
                elif len(keys):
                    store.load_rows(keys, np.ascontiguousarray(values[mine]),
                                    None if touched is None else np.ascontiguousarray(touched[mine]))
                rows[dim] += len(keys)
    for dim, store in store_by_dim.items():
        own_sketch = store.sketch()
        sketches = [np.asarray(sk) for chain in chains
                    if (sk := _open_sketch(chain[-1][0], chain[-1][1]["tables"][str(dim)], dim)) is not None]
        if own_sketch is not None and any(sk.shape != own_sketch.shape for sk in sketches):
            _log.warning("checkpoint sketch has another shape; admission counts start from zero", dim=dim,
                         checkpoint=[sk.shape for sk in sketches], store=own_sketch.shape)
        else:
            store.merge_sketch(sketches)
        if store.stats()["evictions"] > evictions[dim] and store.tier is None:
            _log.warning("checkpoint holds more rows than the store's capacity; the oldest were evicted",
                         dim=dim, rows=rows[dim], capacity=store.config.capacity)
    step = found[0][1]["step"]
    _log.info("ps shard checkpoint loaded", directory=str(directory), step=step, shard=shard,
              num_shards=num_shards, source_shards=source_shards, rows=rows,
              chains={m["shard"]: m["chain"] for _, m in found})
    applied_by_life = {int(m["life"]): int(m["applied"]) for _, m in found if "life" in m}
    return {"step": step, "rows": rows, "source_shards": source_shards, "applied_by_life": applied_by_life}


def _newest_rows(chain: list[tuple[Path, dict]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, embeddings without state) of width `dim` that a chain holds: each key as its newest dump has it.
    Memory-mapped when the chain is one dump of one part; else gathered (export's in-memory table)."""
    opened = [(*_open_part(path, part, dim, table_row_width(table))[:2], storage_of(table))
              for path, table, part in _parts(chain, dim)]
    if len(opened) == 1:
        return opened[0][0], R.decode_weights(opened[0][1], dim, opened[0][2])
    if not opened:
        return np.zeros(0, np.uint64), np.zeros((0, dim), np.float32)
    keys = np.concatenate([k for k, _, _ in opened])
    values = np.concatenate([R.decode_weights(v, dim, storage) for _, v, storage in opened])
    if len(chain) == 1:  # one full dump: every key once
        return keys, values
    _, last = np.unique(keys[::-1], return_index=True)  # the newest occurrence of each key
    newest = np.sort(keys.shape[0] - 1 - last)
    return keys[newest], values[newest]


def read_embeddings(directory: str | Path) -> tuple[dict, list[tuple[int, int, np.ndarray, np.ndarray]]]:
    """Every shard dump's trained rows, for export: (summary, [(shard, dim, keys, rows), ...]).

    Follows each dump's chain (a delta's rows over its full dump's) and verifies every manifest, size and
    sha256 first (ValueError naming the file, as `load_shard` does) and that each dump holds only its own
    shard's IDs (`hybridrec.core.wire.sharding.shard_of`). `rows` are the embeddings without optimizer state: the
    memory-mapped values' first `dim` columns when a shard's table is one file. `summary` is
    {"num_shards", "step", "widths"}.
    """
    from hybridrec.core.wire.sharding import shard_of

    found = _read_manifests(directory)
    num_shards, step = found[0][1]["num_shards"], found[0][1]["step"]
    widths = sorted(int(w) for w in found[0][1]["tables"])
    out = []
    for path, manifest in found:
        if sorted(int(w) for w in manifest["tables"]) != widths:
            raise ValueError(f"{path / MANIFEST}: widths {sorted(manifest['tables'])} differ from the other shards' "
                             f"{widths}")
        chain = _chain_of(path, manifest)
        for dim in widths:
            for member, table, part in _parts(chain, dim):
                if table["dim"] != dim:
                    raise ValueError(f"{member / MANIFEST}: table {dim} says dim {table['dim']}")
                for entry in (part["keys"], part["values"]):
                    _verify_file(member / entry["file"], entry)
                keys, _, _ = _open_part(member, part, dim, table_row_width(table))
                if keys.size and not np.all(shard_of(np.asarray(keys), num_shards) == manifest["shard"]):
                    raise ValueError(f"{member / part['keys']['file']}: holds IDs of other shards than "
                                     f"{manifest['shard']} of {num_shards}")
            keys, rows = _newest_rows(chain, dim)
            out.append((manifest["shard"], dim, keys, rows))
    return {"num_shards": num_shards, "step": step, "widths": widths}, out
