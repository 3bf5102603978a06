"""Model bundles: a trained model as a self-contained, versioned, verifiable directory.

Written by `hybridrec export` (from a run or a checkpoint) and by a training
job that publishes versions; read by the inference service and by read-only
PS shards. Layout:

    BUNDLE/manifest.json                                  written last; lists every file with size and sha256
    BUNDLE/dense.pt                                       the dense model's state_dict: tensors only
                                                          (torch.load(..., weights_only=True))
    BUNDLE/embeddings/shard-00000-of-00002/dim16.keys.npy  uint64 (n,), sorted ascending
    BUNDLE/embeddings/shard-00000-of-00002/dim16.rows.npy  float32 (n, 16): trained rows, no optimizer state
                                                          (int8 (n, 16) in a quantized bundle, beside
    BUNDLE/embeddings/shard-00000-of-00002/dim16.scales.npy  float16 (n,): each row's scale)

Embeddings are sharded like the PS (`hybridrec.core.wire.sharding.shard_of`), one pair
of arrays per shard and width. Keys are sorted so a lookup is a vectorised
binary search over memory-mapped arrays: nothing is loaded or hashed at
start-up, and a shard bigger than RAM still serves. An ID without a row reads
zeros, as an ID never admitted does in training.

A bundle is refused, naming the file, when its manifest does not parse, is of
another format version, or when any file's size or sha256 differs from the
manifest.

`hybridrec export --quantize int8` writes each row as int8 with one float16
scale (symmetric, row-wise: the row's largest magnitude maps to 127), 18
bytes a row of width 16 instead of 64. Such a bundle is format version 2,
which builds that cannot dequantize refuse by version rather than mis-read;
a float32 bundle stays version 1. Every reader (the inference service, its
read-only PS shards, `hybridrec predict`) dequantizes on lookup, so what
they serve is the same float32 rows.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridrec.core.config import FeatureConfig, ModelConfig, TaskConfig
from hybridrec.core.layouts.files import write_json_atomic

FORMAT = "hybridrec-bundle"
FORMAT_VERSION = 1
QUANTIZED_FORMAT_VERSION = 2
"""The version of a bundle with quantized tables (`quantization`): one a build before them refuses."""
QUANTIZATIONS = ("int8",)
MANIFEST = "manifest.json"
DENSE = "dense.pt"
CONFIG = "config.yaml"
"""The training job's resolved config: how `hybridrec predict` reads data as training read it."""
EMBEDDINGS = "embeddings"
_CHUNK_BYTES = 16 << 20


class BundleError(ValueError):
    """A bundle that cannot be used: the message names the file and what is wrong."""


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bytes: int
    """File size."""
    sha256: str
    """Hex digest of the file's bytes."""


class BundleManifest(BaseModel):
    """What a bundle holds; every file it lists is checked against its size and sha256 before use."""

    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT
    """Always "hybridrec-bundle"."""
    format_version: int = FORMAT_VERSION
    """Layout version: 1, or 2 with quantized tables; a reader refuses any other."""
    quantization: Literal["int8"] | None = None
    """None: float32 rows. "int8": each row as int8 with a float16 scale (`quantize_rows`)."""
    version: int = 0
    """Model version: 0 for an export, increasing for versions a training job publishes."""
    base_version: int | None = None
    """None: the embedding tables hold every row (an export, or a full snapshot a training job published).
    Otherwise this is a delta: the tables hold only the rows changed since version `base_version` of the same
    versions directory, which a reader merges onto that version's table (hybridrec/core/layouts/versions.py). The dense
    weights are always complete."""
    step: int = 0
    """Training steps (per NN worker) behind the weights."""
    features: list[FeatureConfig]
    """ID features in model order: name, group, width, pooling."""
    num_dense: int
    """Dense features the model takes."""
    num_tasks: int = 1
    """Label columns the model was trained on: one output per task (`heads`)."""
    model: ModelConfig
    """Import path and keyword arguments of the dense model."""
    precision: str = "fp32"
    """Precision the dense model was trained in (bf16: serve under bf16 autocast too)."""
    num_shards: int
    """Embedding shards (as the PS had)."""
    rows: dict[int, int] = Field(default_factory=dict)
    """Embedding rows per width, all shards together (a delta: the changed rows it holds)."""
    dense_columns: list[str] = Field(default_factory=list)
    """The dense features' column names in model order (I1..I13 for Criteo), so a request may send each as its
    own FP32 [batch] input; empty in bundles written before they were recorded."""
    input_types: dict[str, str] = Field(default_factory=dict)
    """Feature name -> OIP datatype of its values as the training data held them (BYTES: strings, as every TSV
    field; INT64: integers), for the model metadata: strings and integers hash differently. Empty where the
    export could not tell (a Parquet file no longer there, prepared data)."""
    tasks: list[str] = Field(default_factory=list)
    """The task (label column) of each output, in order, so a multi-task model's answers can be asked for by
    name; empty in bundles written before they were recorded."""
    heads: list[TaskConfig] = Field(default_factory=list)
    """Each output's task as the job configured it (`data.labels`), in order: its kind says how the output is
    answered (binary: the sigmoid of the model's output, a probability; regression: offset + scale x the
    output, a value); empty: every output binary (bundles written before regression tasks)."""
    files: dict[str, FileEntry] = Field(default_factory=dict)
    """Every other file of the bundle, by path relative to it."""
    created: float = Field(default_factory=time.time)
    """Unix time the bundle was written."""

    @property
    def task_heads(self) -> list[TaskConfig]:
        """`heads`, or every output binary in an older bundle."""
        return list(self.heads) or [TaskConfig(name=f"task{t}") for t in range(self.num_tasks)]

    @property
    def widths(self) -> list[int]:
        return sorted({f.dim for f in self.features})


def input_types(config) -> dict[str, str]:
    """`BundleManifest.input_types` of a job: TSV fields are strings; a Parquet feature's type is read from the
    schema of the first training file (integers or strings, or lists of them); prepared data says nothing."""
    if config.data.format == "tsv":
        return {f.name: "BYTES" for f in config.features}
    first = Path(config.data.train[0]) if config.data.train else None
    if first is None or not first.is_file():
        return {}
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(first)
    types: dict[str, str] = {}
    for feature in config.features:
        if feature.source not in schema.names:
            continue
        kind = schema.field(feature.source).type
        while pa.types.is_list(kind) or pa.types.is_large_list(kind):
            kind = kind.value_type
        if pa.types.is_integer(kind):
            types[feature.name] = "INT64"
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
            types[feature.name] = "BYTES"
    return types


def shard_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def table_files(shard: int, num_shards: int, dim: int) -> tuple[str, str]:
    """Relative paths of one shard's keys and rows of width `dim`."""
    base = f"{EMBEDDINGS}/{shard_name(shard, num_shards)}/dim{dim}"
    return f"{base}.keys.npy", f"{base}.rows.npy"


def scales_file(shard: int, num_shards: int, dim: int) -> str:
    """Relative path of one shard's row scales of width `dim` (quantized bundles only)."""
    return f"{EMBEDDINGS}/{shard_name(shard, num_shards)}/dim{dim}.scales.npy"


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 rows, float16 scales) of float32 `rows`: row i is about q[i] * scales[i], each weight within half
    a step (its row's largest magnitude / 127) of its value. The scale is rounded to float16 first and the
    row divided by the rounded scale, so the step is exactly what a reader multiplies by."""
    rows = np.asarray(rows, np.float32)
    top = np.abs(rows).max(axis=1) if rows.shape[0] and rows.shape[1] else np.zeros(rows.shape[0], np.float32)
    if top.size and float(top.max()) / 127 > float(np.finfo(np.float16).max):
        raise BundleError(f"rows of magnitude up to {float(top.max()):.3g} have no float16 scale: not quantizable")
    scales = (top / 127).astype(np.float16)
    step = scales.astype(np.float32)
    safe = np.where(step > 0, step, 1.0)[:, None]
    q = np.clip(np.rint(rows / safe), -127, 127).astype(np.int8)
    q[step == 0] = 0
    return q, scales


def dequantize(rows: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """float32 rows of a table's rows (float32, or int8 with their float16 `scales`)."""
    if scales is None:
        return rows
    return rows.astype(np.float32) * scales.astype(np.float32)[:, None]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _entry(path: Path) -> FileEntry:
    return FileEntry(bytes=path.stat().st_size, sha256=_sha256(path))


file_entry = _entry  # the size and sha256 of a file, as a manifest lists it


# -- writing ----------------------------------------------------------------------------------
class BundleWriter:
    """Builds a bundle in a hidden sibling directory and renames it into place when `commit` is called.

    A writer killed half-way leaves only the hidden directory (never a bundle
    under the final name, and never a manifest that lists missing files).
    """

    def __init__(self, out: Path, manifest: BundleManifest):
        self.out = Path(out)
        if self.out.exists():
            raise BundleError(f"{self.out} already exists; choose a new bundle directory")
        self.tmp = self.out.with_name(f".{self.out.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.tmp.mkdir(parents=True)
        self.manifest = manifest
        self.manifest.files = {}

    def add_dense(self, state_dict: dict[str, Any]) -> None:
        import torch

        tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
        torch.save(tensors, self.tmp / DENSE)
        self._record(DENSE)

    def add_config(self, config) -> None:
        self.manifest.files[CONFIG] = write_config(config, self.tmp)

    def add_table(self, shard: int, dim: int, keys: np.ndarray, rows: np.ndarray) -> None:
        """One shard's rows of one width (any order: sorted here)."""
        keys = np.asarray(keys, dtype=np.uint64)
        rows = np.asarray(rows, dtype=np.float32)
        if rows.shape != (keys.shape[0], dim):
            raise ValueError(f"table of width {dim}: {keys.shape[0]} keys but rows of shape {rows.shape}")
        order = np.argsort(keys, kind="stable")
        keys_path, rows_path = table_files(shard, self.manifest.num_shards, dim)
        arrays = [(keys_path, keys[order]), (rows_path, rows[order])]
        if self.manifest.quantization == "int8":
            q, scales = quantize_rows(rows[order])
            arrays[1:] = [(rows_path, q), (scales_file(shard, self.manifest.num_shards, dim), scales)]
        for rel, array in arrays:
            (self.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            np.save(self.tmp / rel, np.ascontiguousarray(array), allow_pickle=False)
            self._record(rel)
        self.manifest.rows[dim] = self.manifest.rows.get(dim, 0) + int(keys.shape[0])

    def _record(self, rel: str) -> None:
        self.manifest.files[rel] = _entry(self.tmp / rel)

    def commit(self) -> BundleManifest:
        missing = [(s, d) for s in range(self.manifest.num_shards) for d in self.manifest.widths
                   if table_files(s, self.manifest.num_shards, d)[0] not in self.manifest.files]
        for shard, dim in missing:  # a shard without rows of a width still gets (empty) files
            self.add_table(shard, dim, np.zeros(0, np.uint64), np.zeros((0, dim), np.float32))
        if DENSE not in self.manifest.files:
            raise BundleError("a bundle needs the dense weights (add_dense)")
        write_json_atomic(self.tmp / MANIFEST, self.manifest.model_dump(mode="json"))
        os.rename(self.tmp, self.out)
        return self.manifest

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_config(config, directory: Path) -> FileEntry:
    """The job's config as the bundle's `config.yaml` in `directory`; its manifest entry."""
    from hybridrec.core.config import dump_config

    dump_config(config, Path(directory) / CONFIG)
    return _entry(Path(directory) / CONFIG)


# -- reading ----------------------------------------------------------------------------------
def bundle_config(path: Path):
    """The training job's config a bundle carries (`config.yaml`, checked against the manifest)."""
    from hybridrec.core.config import load_config

    manifest = read_manifest(path)
    if CONFIG not in manifest.files:
        raise BundleError(f"{Path(path) / MANIFEST}: the bundle has no {CONFIG} (written before bundles carried "
                          f"the job's config): export it again")
    verify(path, manifest)
    return load_config(Path(path) / CONFIG)


def read_manifest(path: Path) -> BundleManifest:
    """The manifest of bundle directory `path`; BundleError naming the file when it is not a bundle's."""
    file = Path(path) / MANIFEST
    try:
        manifest = BundleManifest.model_validate_json(file.read_bytes())
    except FileNotFoundError:
        raise BundleError(f"{file}: no manifest (not a bundle, or one still being written)") from None
    except OSError as exc:
        raise BundleError(f"{file}: cannot read: {exc.strerror}") from None
    except ValidationError as exc:
        raise BundleError(f"{file}: not a valid bundle manifest: {exc.errors()[0]['msg']} at "
                          f"{'.'.join(str(p) for p in exc.errors()[0]['loc'])}") from None
    want = FORMAT_VERSION if manifest.quantization is None else QUANTIZED_FORMAT_VERSION
    if manifest.format != FORMAT or manifest.format_version != want:
        raise BundleError(f"{file}: format {manifest.format!r} version {manifest.format_version}"
                          f"{f' ({manifest.quantization} tables)' if manifest.quantization else ''}; this build reads "
                          f"{FORMAT!r} version {FORMAT_VERSION}, and version {QUANTIZED_FORMAT_VERSION} with "
                          f"{' or '.join(QUANTIZATIONS)} tables")
    return manifest


def verify(path: Path, manifest: BundleManifest) -> None:
    """Check every listed file's size and sha256 (and that the tables the manifest implies are listed)."""
    path = Path(path)
    for shard in range(manifest.num_shards):
        for dim in manifest.widths:
            quantized = (scales_file(shard, manifest.num_shards, dim),) if manifest.quantization else ()
            for rel in (*table_files(shard, manifest.num_shards, dim), *quantized):
                if rel not in manifest.files:
                    raise BundleError(f"{path / MANIFEST}: does not list {rel}")
    for rel, entry in manifest.files.items():
        file = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise BundleError(f"{path / MANIFEST}: file path {rel!r} leaves the bundle")
        try:
            size = file.stat().st_size
        except OSError:
            raise BundleError(f"{file}: listed in the manifest but missing") from None
        if size != entry.bytes:
            raise BundleError(f"{file}: {size} bytes, the manifest says {entry.bytes}")
        if _sha256(file) != entry.sha256:
            raise BundleError(f"{file}: sha256 does not match the manifest")


def load_dense(path: Path) -> dict[str, Any]:
    """The dense state_dict, loaded without unpickling anything but tensors."""
    import torch

    file = Path(path) / DENSE
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; the file is what is wrong
        raise BundleError(f"{file}: not loadable as tensors: {exc}") from None


class ShardTable:
    """One shard's rows, per width: sorted keys and rows, memory-mapped; with quantized tables, int8 rows and
    their float16 scales (`scales`; None for float32 rows), dequantized by every lookup."""

    scales: dict[int, np.ndarray | None]

    def __init__(self, path: Path, manifest: BundleManifest, shard: int):
        self.keys: dict[int, np.ndarray] = {}
        self.rows: dict[int, np.ndarray] = {}
        self.scales = {}
        quantized = manifest.quantization is not None
        for dim in manifest.widths:
            keys_rel, rows_rel = table_files(shard, manifest.num_shards, dim)
            scales_rel = scales_file(shard, manifest.num_shards, dim)
            try:
                # Mapped, then viewed as plain arrays: numpy's memmap subclass costs microseconds per
                # indexing call, which a batch-1 request pays several times over.
                self.keys[dim] = np.load(path / keys_rel, mmap_mode="r", allow_pickle=False).view(np.ndarray)
                self.rows[dim] = np.load(path / rows_rel, mmap_mode="r", allow_pickle=False).view(np.ndarray)
                self.scales[dim] = (np.load(path / scales_rel, mmap_mode="r", allow_pickle=False).view(np.ndarray)
                                    if quantized else None)
            except (OSError, ValueError) as exc:
                raise BundleError(f"{path / keys_rel}: cannot map: {exc}") from None
            n = self.keys[dim].shape[0]
            if (self.keys[dim].dtype != np.uint64 or self.rows[dim].dtype != (np.int8 if quantized else np.float32)
                    or self.rows[dim].shape != (n, dim)):
                raise BundleError(f"{path / rows_rel}: keys {self.keys[dim].dtype} {self.keys[dim].shape} and rows "
                                  f"{self.rows[dim].dtype} {self.rows[dim].shape} do not form a "
                                  f"{manifest.quantization or 'float32'} table of width {dim}")
            if quantized and (self.scales[dim].dtype != np.float16 or self.scales[dim].shape != (n,)):
                raise BundleError(f"{path / scales_rel}: {self.scales[dim].dtype} {self.scales[dim].shape}, not the "
                                  f"float16 scales of {n} rows")

    def rows_at(self, dim: int, at: np.ndarray) -> np.ndarray:
        """float32 rows at positions `at` of the width's table (dequantized where quantized)."""
        scales = self.scales.get(dim)
        return dequantize(self.rows[dim][at], None if scales is None else scales[at])

    def lookup(self, dim: int, ids: np.ndarray) -> np.ndarray:
        """float32 (n, dim): each ID's row, zeros for IDs without one."""
        keys = self.keys[dim]
        out = np.zeros((ids.shape[0], dim), np.float32)
        if keys.shape[0] == 0 or ids.shape[0] == 0:
            return out
        at = np.minimum(np.searchsorted(keys, ids), keys.shape[0] - 1)
        hit = keys[at] == ids
        out[hit] = self.rows_at(dim, at[hit])
        return out


class EmbeddingTable:
    """All shards of a bundle in this process: what the inference service looks rows up in."""

    def __init__(self, shards: list[ShardTable]):
        from hybridrec.core.model import table_lookup

        quantized = any(v is not None for s in shards for v in s.scales.values())
        table_lookup.warm_up(quantized)  # its kernel compiled (or loaded from numba's cache) now, not at the first lookup
        self.shards = shards
        # width -> every shard's keys, rows and scales (None: float32 rows)
        self._arrays: dict[int, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]] = {}

    def lookup(self, dim: int, ids: np.ndarray) -> np.ndarray:
        """float32 (n, dim): each ID's row in the shard that owns it, zeros for IDs without one (one compiled
        pass: `hybridrec.core.model.table_lookup`; quantized rows dequantized in it)."""
        from hybridrec.core.model.table_lookup import lookup_into

        arrays = self._arrays.get(dim)
        if arrays is None:
            scales = [s.scales[dim] for s in self.shards]
            arrays = self._arrays[dim] = ([s.keys[dim] for s in self.shards], [s.rows[dim] for s in self.shards],
                                          None if any(x is None for x in scales) else scales)
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty((ids.shape[0], dim), np.float32)
        lookup_into(arrays[0], arrays[1], ids, out, arrays[2])
        return out


def open_bundle(path: Path, *, check: bool = True) -> tuple[BundleManifest, EmbeddingTable]:
    """Manifest and embedding table of a bundle (verified unless `check` is False)."""
    path = Path(path)
    manifest = read_manifest(path)
    if check:
        verify(path, manifest)
    return manifest, EmbeddingTable([ShardTable(path, manifest, s) for s in range(manifest.num_shards)])


def iter_tables(path: Path, manifest: BundleManifest) -> Iterable[tuple[int, int, np.ndarray, np.ndarray]]:
    """(shard, width, keys, float32 rows) of every table of a bundle: memory-mapped, or dequantized."""
    for shard in range(manifest.num_shards):
        table = ShardTable(Path(path), manifest, shard)
        for dim in manifest.widths:
            yield shard, dim, table.keys[dim], dequantize(table.rows[dim], table.scales[dim])
