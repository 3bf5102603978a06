"""Every data-plane frame of hybridrec: one typed encode/decode pair per frame kind.

A frame's bytes are laid out by `hybridrec.core.wire.codec` (header, JSON meta, 64-byte
aligned tensor buffers) — but for `DenseBatch`, the one frame an NN worker's
receiver process hands its trainer as it came: a fixed header that one
`struct` call reads, then its arrays (`DenseBatch.encode`). *What* each frame
holds is decided here and nowhere else. The encoder of a frame sits next to
its decoder so the two ends cannot drift apart, and no tensor or meta key of a frame is spelled outside this
module. Every decoder treats its input as untrusted: anything truncated,
oversized, of the wrong dtype or shape, or inconsistent with itself raises
`codec.FrameError` (a ValueError), which every service turns into
INVALID_ARGUMENT with the reason, and keeps serving.

| frame          | RPC (sender -> receiver)                                   | holds                                    |
|----------------|------------------------------------------------------------|------------------------------------------|
| `SparseBatch`  | EmbeddingWorker.PutBatch request (data loader -> EW)        | the batch's KeyedBags of uint16 positions; per feature its unique IDs |
| `BatchRef`     | EmbeddingWorker.PutBatch reply, EmbeddingWorker.Lookup request | the batch_ref naming a buffered batch |
| `DenseBatch`   | NNWorker.PutBatch request (data loader -> NN worker)        | dense features, labels, batch_ref, stream position |
| `EndOfPhase`   | NNWorker.PutBatch request                                   | end of the train or eval stream, with the reader's counters |
| `Embeddings`   | EmbeddingWorker.Lookup reply (EW -> NN worker)              | the same KeyedBags of positions; each feature's unique rows (per width) |
| `Gradients`    | EmbeddingWorker.PushGradients request (NN worker -> EW)     | one gradient per row of the `Embeddings` frame |
| `PSLookup`     | EmbeddingPS.Lookup request (EW -> PS shard)                 | unique IDs per width, train or eval |
| `PSRows`       | EmbeddingPS.Lookup reply                                     | one row per requested ID, per width |
| `PSUpdate`     | EmbeddingPS.Update request (EW -> PS shard)                 | unique IDs and their summed gradients, per width; the update's id |
| `Applied`      | EmbeddingPS.Update and EmbeddingWorker.PushGradients replies  | rows the PS applied (0 for a re-sent update) |
| `Consumed`     | NNWorker.PutBatch reply (NN worker -> data loader)          | the phase and the last stream index the rank has trained |
| `Received`     | NNWorker.Received reply (NN worker -> a restarted data loader) | how far the rank holds each phase's stream; recent batch ends |
| `ShardRows`    | EmbeddingPS.Replicate request (PS -> the PS keeping its backup), PullShard reply | whole rows (values and optimizer state) per width; the primary's life and count of applied updates |
| `ShardPull`    | EmbeddingPS.PullShard request (PS -> PS)                    | which shard, which copy (primary or backup), which page |

Float rows and gradients travel as κ-scaled fp16 plus a float32 norm per
vector when `training.compression.fp16` is on (`hybridrec.core.wire.compress.ValueCodec`),
else as float32; ID positions and bag lengths may be lz4-compressed.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from hybridrec.core.wire import codec
from hybridrec.core.wire.codec import FrameError
from hybridrec.core.wire.compress import ValueCodec, check_unique_count
from hybridrec.core.config import Config, ids_per_sample
from hybridrec.core.wire.jagged import Bag, KeyedBags

PHASES = ("train", "eval")

# batch_ref = embedding-worker index (8 bits) | worker incarnation (16 bits) | sequence (40 bits):
# the embedding worker makes refs, the NN worker routes each lookup by the top bits.
REF_SHIFT = 56
INCARNATION_SHIFT = 40
POSITION_FIELDS = 4
"""A training batch's position: (epoch, file, byte offset, line) after it (services/dataloader/batching.py)."""
MAX_BATCH = 65535
"""Samples per batch: positions and bag lengths travel as uint16."""


def bag_bytes(num_features: int, ids_per_sample: int, batch_size: int = MAX_BATCH) -> int:
    """The most raw bytes a batch's bags take (SparseBatch, Embeddings): its positions (uint16, at most
    `ids_per_sample` a sample: one per scalar feature, `max_len` per list feature) and bag lengths (uint16, one
    per feature and sample). The lz4 budget `codec.decode` is given for them."""
    return 2 * batch_size * (ids_per_sample + num_features)


def max_ids(config: Config) -> int:
    """The most IDs one batch of this job holds, and so the most one request of its data plane names (a PS
    shard's lookup or update, a batch put on an embedding worker): the larger batch size (training or
    evaluation) times the IDs a sample holds (one per scalar feature, `max_len` per list feature)."""
    training = config.training
    return max(training.batch_size, training.eval_batch_size) * ids_per_sample(config.features)


MAX_REQUEST_BYTES = 1 << 30
"""No request is larger, whatever the config (gRPC's own limit, as before requests were bounded)."""


def max_request_bytes(config: Config) -> int:
    """The largest request a data-plane service of this job can be sent, what its gRPC server accepts: each ID
    of a batch with its position and a row of the widest table with two optimizer-state rows (a replica's
    shipment), each sample's dense values, labels and bag lengths, and room for headers. Raised by
    `training.batch_size` / `eval_batch_size`, the features' `max_len` and widths."""
    training = config.training
    batch = max(training.batch_size, training.eval_batch_size)
    width = max((f.dim for f in config.features), default=1)
    per_id = 8 + 2 + 4 * 3 * width + 8
    per_sample = 4 * (config.num_dense + config.label_columns) + 2 * len(config.features)
    return min(max_ids(config) * per_id + batch * per_sample + (4 << 20), MAX_REQUEST_BYTES)


def check_ids(count: int, bound: int | None, what: str) -> None:
    """FrameError naming the bound and the keys that raise it when a request names more than `bound` IDs."""
    if bound is not None and count > bound:
        raise FrameError(f"{what} of {count} IDs, past this job's bound of {bound} (the larger of "
                         f"training.batch_size and eval_batch_size times the IDs a sample holds: one per scalar "
                         f"feature, max_len per list feature)")


def _check_positions_bound(count: int, batch_size: int, ids_per_sample: int | None) -> None:
    """A batch's positions are at most `ids_per_sample` a sample (None: not checked)."""
    if ids_per_sample is not None and count > batch_size * ids_per_sample:
        raise FrameError(f"{count} IDs in a batch of {batch_size}: at most {ids_per_sample} a sample (one per "
                         f"scalar feature, max_len per list feature)")


def make_batch_ref(worker: int, incarnation: int, seq: int) -> int:
    return (worker << REF_SHIFT) | (incarnation << INCARNATION_SHIFT) | seq


def worker_of_ref(ref: int) -> int:
    return ref >> REF_SHIFT


_U64 = (1 << 64) - 1


def update_id(batch_ref: int, nonce: int) -> int:
    """The id of a batch's gradient update on the PS shards: the same in every re-send of it.

    A PS shard applies each id at most once, so an embedding worker that
    re-sends an update (it restarted mid-push, or a shard restarted before
    answering) never applies it twice. The id is splitmix64's finalizer of
    batch_ref ^ nonce, where `nonce` is a random 64-bit number the worker drew
    when its buffer was created (`BufferFiles`): the finalizer is a bijection,
    so the batches of one buffer never share an id, and the nonce keeps them
    apart from the ids of another worker, of a buffer lost with its machine, or
    of an earlier job on the same PS store (a collision is a 2**-64 event).
    Never 0, the PS's mark of an empty slot: the worker draws a nonce whose top
    byte differs from its own index in every batch_ref, so batch_ref ^ nonce is
    never 0, and the finalizer maps only 0 to 0.
    """
    z = (batch_ref ^ nonce) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _phase(frame: codec.Frame) -> str:
    phase = frame.meta.get("phase", "train")
    if phase not in PHASES:
        raise FrameError(f"phase {phase!r} is not one of {PHASES}")
    return phase


def _batch_ref(frame: codec.Frame) -> int:
    ref = frame.meta_int("batch_ref")
    if not 0 <= ref <= _U64:
        raise FrameError(f"batch_ref {ref} is not a uint64")
    return ref


def _per_width(prefix: str, tensors: Iterable[str], dims: Iterable[int]) -> list[int]:
    """Widths named by the tensors `prefix.<width>` of a frame, each one the receiver keeps."""
    known = set(dims)
    found = []
    for name in tensors:
        if name.startswith(prefix + ".") and not name.endswith(".norm"):  # .norm: fp16 scales, see ValueCodec
            width = name[len(prefix) + 1:]
            if not width.isdigit() or int(width) not in known:
                raise FrameError(f"no embedding table of width {width!r} here (widths: {sorted(known)})")
            found.append(int(width))
    return found


def _unpack(values: ValueCodec, frame: codec.Frame, name: str, dim: int, rows: int | None = None, *,
            keep_fp16: bool = False) -> np.ndarray:
    """float32 (rows, dim) values of tensor `name` (`Fp16Rows` with `keep_fp16`, when they came as fp16);
    FrameError when missing or of another shape."""
    if name not in frame.tensors:
        raise FrameError(f"frame has no tensor {name!r}")
    out = values.unpack(frame.tensors, name, dim, keep_fp16=keep_fp16)
    if out.ndim != 2 or out.shape[1] != dim or (rows is not None and out.shape[0] != rows):
        want = f"({rows}, {dim})" if rows is not None else f"(n, {dim})"
        raise FrameError(f"tensor {name!r} has shape {out.shape}, expected {want}")
    return out


# -- data loader -> embedding worker ----------------------------------------------------------
@dataclass
class SparseBatch:
    """ID features of one batch, each deduplicated: `bags` is the batch's `KeyedBags` whose values are uint16
    positions into the feature's unique IDs, so feature f of sample i holds uniq[f][bags.bag(f) of sample i]."""

    bags: KeyedBags  # values uint16 (nnz,) positions, lengths uint16 (F, batch_size)
    uniq: list[np.ndarray]  # uint64 (U_f,) per feature
    phase: str = "train"

    @property
    def batch_size(self) -> int:
        return len(self.bags)

    @classmethod
    def from_columns(cls, ids: np.ndarray, present: np.ndarray, *, phase: str) -> "SparseBatch":
        """From single-valued columns (n, F) with a presence mask (Criteo: one ID or none per field)."""
        return cls.from_bags(KeyedBags.from_columns(ids, present), phase=phase)

    def ids(self, f: int) -> Bag:
        """Feature f's bags of IDs (its positions looked up in its unique IDs)."""
        bag = self.bags.bag(f)
        return Bag(self.uniq[f][bag.values], bag.offsets, bag.known_lengths)

    @classmethod
    def from_bags(cls, bags: KeyedBags, *, phase: str) -> "SparseBatch":
        """Deduplicate every feature of a batch in one compiled pass (`hybridrec.core.wire.dedup.unique_segments`)."""
        # numba: the NN workers, which import frames, never need it
        from hybridrec.core.wire.dedup import unique_segments

        if len(bags) > MAX_BATCH:
            raise ValueError(f"a batch of {len(bags)} samples exceeds {MAX_BATCH}")
        uniq, pos = unique_segments(bags.values, bags.bounds)
        check_unique_count(max((u.shape[0] for u in uniq), default=0))
        return cls(KeyedBags(pos, bags.lengths.astype(np.uint16)), uniq, phase)

    def encode(self, *, lz4: bool = True) -> bytes:
        tensors: dict[str, np.ndarray] = {}
        bounds = self.bags.bounds
        for f, u in enumerate(self.uniq):
            tensors[f"u{f}"] = u
            tensors[f"p{f}"] = self.bags.values[bounds[f]:bounds[f + 1]]
            tensors[f"n{f}"] = self.bags.lengths[f]
        compress = {name for name in tensors if name[0] in "pn"} if lz4 else set()
        return codec.encode(tensors, {"batch_size": self.batch_size, "phase": self.phase}, compress=compress)

    @classmethod
    def decode(cls, buf: bytes, num_features: int, ids_per_sample: int | None = None) -> "SparseBatch":
        """`ids_per_sample`: the most IDs a sample holds (one per scalar feature, `max_len` per list feature);
        None: every feature scalar. What decompresses, and the positions sent, are bounded by it."""
        ids_per_sample = num_features if ids_per_sample is None else ids_per_sample
        names = frozenset(f"{kind}{f}" for f in range(num_features) for kind in "pn")
        frame = codec.decode(buf, lz4=names, lz4_bytes=bag_bytes(num_features, ids_per_sample))
        batch_size = frame.meta_int("batch_size")
        if not 0 < batch_size <= MAX_BATCH:
            raise FrameError(f"batch_size {batch_size} outside [1, {MAX_BATCH}]")
        phase = _phase(frame)
        if len(frame.tensors) != 3 * num_features:
            raise FrameError(f"expected {3 * num_features} tensors for {num_features} features, "
                             f"got {len(frame.tensors)}")
        uniq, pos, lengths = [], [], []
        for f in range(num_features):
            u = frame.get(f"u{f}", np.uint64, 1)
            p = frame.get(f"p{f}", np.uint16, 1)
            n = frame.get(f"n{f}", np.uint16, 1)
            if n.shape[0] != batch_size:
                raise FrameError(f"feature {f}: {n.shape[0]} bag lengths for a batch of {batch_size}")
            if int(n.sum(dtype=np.int64)) != p.shape[0]:
                raise FrameError(f"feature {f}: bag lengths add up to {int(n.sum(dtype=np.int64))}, "
                                 f"but {p.shape[0]} positions were sent")
            if p.size and int(p.max()) >= u.shape[0]:
                raise FrameError(f"feature {f}: position {int(p.max())} outside {u.shape[0]} unique IDs")
            if u.shape[0] > p.shape[0]:  # each unique ID is some sample's: no more of them than positions
                raise FrameError(f"feature {f}: {u.shape[0]} unique IDs for {p.shape[0]} positions")
            uniq.append(u)
            pos.append(p)
            lengths.append(n)
        _check_positions_bound(sum(p.shape[0] for p in pos), batch_size, ids_per_sample)
        values = np.concatenate(pos) if pos else np.zeros(0, np.uint16)
        lengths_all = np.stack(lengths) if lengths else np.zeros((0, batch_size), np.uint16)
        return cls(KeyedBags(values, lengths_all), uniq, phase)


@dataclass
class BatchRef:
    """Names a batch buffered on an embedding worker: PutBatch's reply, and what an NN worker looks up."""

    batch_ref: int

    def encode(self) -> bytes:
        return codec.encode(meta={"batch_ref": self.batch_ref})

    @classmethod
    def decode(cls, buf: bytes) -> "BatchRef":
        return cls(_batch_ref(codec.decode(buf)))


# -- data loader -> NN worker -----------------------------------------------------------------
@dataclass
class DenseBatch:
    """Dense features and labels of one batch, and where its embeddings wait."""

    batch_ref: int
    dense: np.ndarray  # float32 (B, num_dense)
    labels: np.ndarray  # float32 (B,), or (B, tasks) with several label columns
    phase: str = "train"
    seq: int = 0
    """Index of the batch in its data loader's training stream (all ranks together)."""
    position: tuple[int, ...] = ()
    """Where the data loader resumes reading after this batch (epoch, file, byte offset, line)."""
    rows_before: int = 0
    """Samples of this phase the data loader sent this batch's rank before it (since the loader started): a
    replacement NN worker takes over its predecessor's sample count from it."""
    loader: int = 0
    """The data loader that sent it (its index in cluster.dataloader): `seq` counts that loader's stream."""

    def encode(self) -> bytes:
        """`_DENSE_HEAD` (magic, version, phase, position fields, batch_ref, seq, rows_before, loader, rows, dense
        features, label columns (0: labels of one task, shape (rows,))), the position fields (uint64), zeros to a
        64-byte boundary, then the dense features (float32, rows x features) and the labels (float32). Not a codec
        frame: the NN worker reads it with one `struct` call (4 us in a loop, against 8 to decode a codec frame's
        table and JSON meta) on the trainer's event loop, where a receiver process hands it over as it came."""
        if self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r} is not one of {PHASES}")
        if len(self.position) > MAX_POSITION_FIELDS or not all(0 <= v < 1 << 64 for v in self.position):
            raise ValueError(f"position must be at most {MAX_POSITION_FIELDS} fields that fit 64 bits, got "
                             f"{list(self.position)}")
        dense = np.ascontiguousarray(self.dense, np.float32)
        labels = np.ascontiguousarray(self.labels, np.float32)
        rows, width = dense.shape
        columns = 0 if labels.ndim == 1 else labels.shape[1]
        head = _DENSE_HEAD.pack(_DENSE_MAGIC, _DENSE_VERSION, PHASES.index(self.phase), len(self.position),
                                self.batch_ref, self.seq, self.rows_before, self.loader, rows, width, columns)
        head += struct.pack(f"<{len(self.position)}Q", *self.position)
        return b"".join((head, bytes(codec.align(len(head)) - len(head)), memoryview(dense).cast("B"),
                         memoryview(labels).cast("B")))


_DENSE_MAGIC = b"HRDB"
_DENSE_VERSION = 1
_DENSE_HEAD = struct.Struct("<4sHBBQqQIIII")
MAX_POSITION_FIELDS = 16
_END_FIELDS = ("end_of", "loader", "end_seq", "rows_sent")


@dataclass
class EndOfPhase:
    """A data loader sent its last batch of a phase; `meta` carries its reader counters."""

    phase: str
    meta: dict[str, Any] = field(default_factory=dict)
    loader: int = 0
    """The data loader whose phase ended."""
    end_seq: int = -1
    """The index after the last batch of the loader's stream of this phase (-1: not said): a rank that gets the
    end before it has taken every batch of its share is behind the loader."""
    rows_sent: int = 0
    """Samples of this phase the loader sent this rank in all (as `DenseBatch.rows_before`)."""

    def encode(self) -> bytes:
        return codec.encode(meta={"end_of": self.phase, "loader": int(self.loader), "end_seq": int(self.end_seq),
                                  "rows_sent": int(self.rows_sent), **self.meta})


def decode_nn_batch(buf: bytes | memoryview, num_dense: int, label_columns: int = 1,
                    loaders: int = 1) -> DenseBatch | EndOfPhase:
    """What a data loader sent an NN worker: a dense batch, or the end of a phase. Labels are (B,) with one
    column, (B, label_columns) with several (`Config.label_columns`: the tasks', then a weight column's);
    `loaders`: how many data loaders there are (cluster.dataloader)."""
    if bytes(memoryview(buf)[:len(_DENSE_MAGIC)]) == _DENSE_MAGIC:
        return _decode_dense(buf, num_dense, label_columns, loaders)
    frame = codec.decode(buf)
    loader = frame.meta_int("loader", default=0)
    if not 0 <= loader < loaders:
        raise FrameError(f"loader {loader} is not one of the {loaders} data loaders")
    end_of = frame.meta.get("end_of")
    if end_of is None:
        raise FrameError("a frame to an NN worker is a dense batch or an end of phase; this one is neither")
    if end_of not in PHASES:
        raise FrameError(f"end_of must be one of {PHASES}, got {end_of!r}")
    if frame.tensors:
        raise FrameError("an end-of-phase frame carries no tensors")
    end_seq, rows_sent = frame.meta_int("end_seq", default=-1), frame.meta_int("rows_sent", default=0)
    if end_seq < -1 or rows_sent < 0:
        raise FrameError(f"end_seq {end_seq} and rows_sent {rows_sent} must be >= -1 and >= 0")
    return EndOfPhase(end_of, {k: v for k, v in frame.meta.items() if k not in _END_FIELDS}, loader=loader,
                      end_seq=end_seq, rows_sent=rows_sent)


def _decode_dense(buf: bytes | memoryview, num_dense: int, label_columns: int, loaders: int) -> DenseBatch:
    """`DenseBatch.encode`'s bytes: its arrays are views of `buf`."""
    mv = memoryview(buf).cast("B")
    size = mv.nbytes
    if size < _DENSE_HEAD.size:
        raise FrameError(f"a dense batch of {size} bytes is shorter than its header")
    _, version, phase, npos, ref, seq, rows_before, loader, rows, width, columns = _DENSE_HEAD.unpack_from(mv)
    if version != _DENSE_VERSION:
        raise FrameError(f"unsupported dense batch version {version} (this build reads {_DENSE_VERSION})")
    if phase >= len(PHASES):
        raise FrameError(f"phase {phase} is not one of {PHASES}")
    if not loader < loaders:
        raise FrameError(f"loader {loader} is not one of the {loaders} data loaders")
    if npos > MAX_POSITION_FIELDS:
        raise FrameError(f"position of {npos} fields; at most {MAX_POSITION_FIELDS}")
    if columns != (0 if label_columns == 1 else label_columns):
        raise FrameError(f"labels of {columns or 1} column(s), not the job's {label_columns} (its tasks', and a "
                         f"weight column's when it has one)")
    if width != num_dense or rows == 0:
        raise FrameError(f"dense ({rows}, {width}) and labels do not form a batch with {num_dense} dense features")
    if rows > MAX_BATCH:
        raise FrameError(f"batch of {rows} samples exceeds {MAX_BATCH}")
    start = codec.align(_DENSE_HEAD.size + 8 * npos)
    values = rows * (width + max(columns, 1))
    if size != start + 4 * values:
        raise FrameError(f"a dense batch of {rows} rows, {width} dense features and {columns or 1} label column(s) "
                         f"takes {start + 4 * values} bytes, not {size}")
    position = struct.unpack_from(f"<{npos}Q", mv, _DENSE_HEAD.size)
    data = np.frombuffer(mv, np.float32, values, start)
    dense, labels = data[:rows * width].reshape(rows, width), data[rows * width:]
    return DenseBatch(ref, dense, labels.reshape(rows, columns) if columns else labels, PHASES[phase], seq,
                      position, rows_before, loader)


# -- embedding worker <-> NN worker -----------------------------------------------------------
@dataclass
class Embeddings:
    """One batch's embeddings as the embedding worker sends them (deduplicated, not pooled).

    `rows[w]` holds the unique rows of every feature of width w, features in
    config order; `bags` is the batch's `KeyedBags` whose values are uint16
    positions into the feature's own rows (its `counts[f]` of them): the
    `SparseBatch`'s bags, passed on. The NN worker pools.
    """

    bags: KeyedBags  # values uint16 (sum of bag lengths,), lengths uint16 (F, batch_size)
    counts: np.ndarray  # int32 (F,): unique rows of each feature
    rows: dict[int, np.ndarray]  # width -> float32 (sum of counts of that width's features, width)

    @property
    def batch_size(self) -> int:
        return len(self.bags)

    def encode(self, values: ValueCodec, *, lz4: bool = True) -> bytes:
        tensors: dict[str, np.ndarray] = {"counts": self.counts, "pos": self.bags.values,
                                          "lengths": self.bags.lengths}
        for dim, rows in self.rows.items():
            tensors.update(values.pack(f"rows.{dim}", rows, dim))
        return codec.encode(tensors, {"batch_size": self.batch_size}, compress=_EMBEDDING_LZ4 if lz4 else set())

    @classmethod
    def decode(cls, buf: bytes, values: ValueCodec, widths: Sequence[int], batch_size: int, *,
               keep_fp16: bool = False, ids_per_sample: int | None = None) -> "Embeddings":
        """`widths`: the embedding width of every feature, in config order. `keep_fp16`: fp16 rows stay fp16
        (`hybridrec.core.wire.compress.Fp16Rows`), for a receiver that scales them back on its GPU. `ids_per_sample`: as
        for `SparseBatch.decode`."""
        ids_per_sample = len(widths) if ids_per_sample is None else ids_per_sample
        return cls.from_frame(cls.decode_frame(buf, len(widths), batch_size, ids_per_sample), values, widths,
                              batch_size, keep_fp16=keep_fp16, ids_per_sample=ids_per_sample)

    @staticmethod
    def decode_frame(buf: bytes, num_features: int, batch_size: int, ids_per_sample: int) -> codec.Frame:
        """The codec's decoding of an `Embeddings` frame of a batch of `batch_size`: its positions and lengths
        the only tensors it may decompress, within what such a batch can hold."""
        return codec.decode(buf, lz4=_EMBEDDING_LZ4,
                            lz4_bytes=bag_bytes(num_features, ids_per_sample, max(batch_size, 0)))

    @classmethod
    def from_frame(cls, frame: codec.Frame, values: ValueCodec, widths: Sequence[int], batch_size: int, *,
                   keep_fp16: bool = False, ids_per_sample: int | None = None) -> "Embeddings":
        """`decode` of a frame the codec decoded (a receiver keeps its arrays: `EmbeddingArrays`)."""
        num = len(widths)
        counts = frame.get("counts", np.int32, 1)
        lengths = frame.get("lengths", np.uint16, 2)
        pos = frame.get("pos", np.uint16, 1)
        if counts.shape[0] != num or lengths.shape != (num, batch_size) or (counts < 0).any():
            raise FrameError(f"embedding frame does not describe {num} features of a batch of {batch_size}")
        _check_positions_bound(pos.shape[0], batch_size, ids_per_sample)
        bags = KeyedBags(pos, lengths)
        bounds = bags.bounds
        if int(bounds[-1]) != pos.shape[0]:
            raise FrameError(f"bag lengths add up to {int(bounds[-1])} but {pos.shape[0]} positions came")
        _check_positions(pos, bounds, counts)
        widths_arr = np.asarray(widths)
        rows = {}
        for dim in sorted(set(widths)):
            expected = int(counts[widths_arr == dim].sum(dtype=np.int64))
            rows[dim] = _unpack(values, frame, f"rows.{dim}", dim, expected, keep_fp16=keep_fp16)
        return cls(bags, counts, rows)


_EMBEDDING_LZ4 = frozenset({"pos", "lengths"})
"""The tensors of an `Embeddings` frame its encoder compresses (`Embeddings.encode`)."""


@dataclass
class EmbeddingArrays:
    """An `Embeddings` frame's arrays as the embedding worker sent them, not scaled back: what an NN worker's
    receiver hands its trainer (`hybridrec.core.layouts.slot_layouts.CheckedEmbeddings`) once the frame is checked."""

    pos: np.ndarray  # uint16: each bag element's position within its feature's rows
    lengths: np.ndarray  # uint16 (features, batch): bag lengths
    rows: dict[int, np.ndarray]  # width -> its rows: fp16 (κ-scaled) or float32
    norms: dict[int, np.ndarray]  # width -> the fp16 rows' float32 norms (absent for float32 rows)

    @classmethod
    def of(cls, frame: codec.Frame) -> "EmbeddingArrays":
        """The arrays of an `Embeddings` frame the codec decoded (and `Embeddings.from_frame` checked)."""
        rows, norms = {}, {}
        for name, array in frame.tensors.items():
            parts = name.split(".")
            if parts[0] == "rows":
                (rows if len(parts) == 2 else norms)[int(parts[1])] = array
        return cls(frame.tensors["pos"], frame.tensors["lengths"], rows, norms)


def _check_positions(pos: np.ndarray, bounds: np.ndarray, counts: np.ndarray) -> None:
    """Every feature's positions within its own rows: one `maximum.reduceat` over the features with elements
    (a receiver indexes rows with them unchecked)."""
    filled = np.flatnonzero(bounds[1:] > bounds[:-1])
    if not filled.size:
        return
    highest = np.maximum.reduceat(pos, bounds[filled])
    bad = np.flatnonzero(highest >= counts[filled])
    if bad.size:
        f = int(filled[bad[0]])
        raise FrameError(f"feature {f}: position {int(highest[bad[0]])} outside its {int(counts[f])} rows")


@dataclass
class Gradients:
    """An NN worker's embedding gradients for one batch: one per row of its `Embeddings` frame."""

    batch_ref: int
    grads: dict[int, np.ndarray]  # width -> float32 (rows of that width, width)

    def encode(self, values: ValueCodec) -> bytes:
        return self.encode_packed(self.batch_ref, self.packed(values))

    def packed(self, values: ValueCodec) -> dict[str, np.ndarray]:
        """The frame's tensors (`encode_packed`'s), packed on the host."""
        tensors: dict[str, np.ndarray] = {}
        for dim, grad in self.grads.items():
            tensors.update(values.pack(f"grad.{dim}", grad, dim))
        return tensors

    @staticmethod
    def pack_tensors(values: ValueCodec, grads: dict) -> dict:
        """The frame's tensors of torch gradients (width -> (rows, width)), packed where they are
        (`ValueCodec.pack_tensors`): the NN worker quantises on its device and copies the result to the host."""
        out = {}
        for dim, grad in grads.items():
            out.update(values.pack_tensors(f"grad.{dim}", grad, dim))
        return out

    @staticmethod
    def cut_tensors(tensors: dict, rows: dict[int, int]) -> dict:
        """`pack_tensors`' tensors of gradients whose rows go on past the real ones (a captured step's padding
        rows), each cut to the first `rows[width]` rows of its width."""
        return {key: tensor[:rows[int(key.split(".")[1])]] for key, tensor in tensors.items()}

    @staticmethod
    def encode_packed(batch_ref: int, tensors: dict[str, np.ndarray]) -> bytes:
        """The frame of gradients packed already (`ValueCodec.pack_tensors` on the NN worker's device: `grad.{d}`
        and, as fp16, `grad.{d}.norm`)."""
        return codec.encode(tensors, {"batch_ref": batch_ref})

    @staticmethod
    def encode_packed_into(allocate: Callable[[int], memoryview], batch_ref: int,
                           tensors: dict[str, np.ndarray]) -> int:
        """`encode_packed` into the buffer `allocate(nbytes)` returns (the NN worker's shared-memory slot for
        its receiver); returns the frame's length."""
        return codec.encode_into(allocate, tensors, {"batch_ref": batch_ref})

    @staticmethod
    def encode_discard(batch_ref: int) -> bytes:
        """A batch's update that applies nothing: its step's loss or gradients were not finite (the NN workers'
        guard, `training.on_nonfinite`). The embedding worker lets the batch go without touching a PS row."""
        return codec.encode(meta={"batch_ref": batch_ref, "discard": 1})

    @staticmethod
    def encode_discard_into(allocate: Callable[[int], memoryview], batch_ref: int) -> int:
        """`encode_discard` into the buffer `allocate(nbytes)` returns; returns the frame's length."""
        return codec.encode_into(allocate, {}, {"batch_ref": batch_ref, "discard": 1})

    @staticmethod
    def batch_ref_of(buf: bytes) -> int:
        """The batch_ref the frame names, before its tensors are checked: the embedding worker needs it to
        tell a re-sent push of a batch it has already applied from one it must decode."""
        return _batch_ref(codec.decode(buf))

    @staticmethod
    def peek(buf: bytes) -> tuple[int, bool]:
        """(batch_ref, whether the frame is a discard) before its tensors are checked; a discard carries none."""
        frame = codec.decode(buf)
        discard = frame.meta.get("discard", 0)
        if discard not in (0, 1) or isinstance(discard, bool):
            raise FrameError(f"frame meta 'discard' must be 0 or 1, got {discard!r}")
        if discard and frame.tensors:
            raise FrameError("a discarded update carries no tensors")
        return _batch_ref(frame), bool(discard)

    @classmethod
    def decode(cls, buf: bytes, values: ValueCodec,
               rows_of: Callable[[int], dict[int, int]]) -> "Gradients":
        """`rows_of(batch_ref)`: width -> rows of that batch's `Embeddings` frame; each must come back."""
        frame = codec.decode(buf)
        expected = rows_of(ref := _batch_ref(frame))
        _per_width("grad", frame.tensors, expected)
        return cls(ref, {d: _unpack(values, frame, f"grad.{d}", d, n) for d, n in expected.items()})


@dataclass
class Applied:
    """How many rows an update applied (0 for frames that apply nothing, e.g. NNWorker.PutBatch), and which life
    of each PS shard acknowledged it (`lives`: (shard, life) pairs; services/embedding_ps/lives.py): a PS shard
    names its own, an embedding worker every shard the update reached."""

    applied: int = 0
    lives: tuple[tuple[int, int], ...] = ()

    def encode(self) -> bytes:
        meta: dict = {"applied": int(self.applied)}
        if self.lives:
            meta["lives"] = [[int(shard), int(life)] for shard, life in self.lives]
        return codec.encode(meta=meta)

    @classmethod
    def decode(cls, buf: bytes) -> "Applied":
        frame = codec.decode(buf)
        lives = frame.meta.get("lives", [])
        if not isinstance(lives, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                            for v in p) for p in lives):
            raise FrameError(f"frame meta 'lives' must be a list of [shard, life] integer pairs, got {lives!r}")
        return cls(frame.meta_int("applied", default=0), tuple((s, life) for s, life in lives))


@dataclass
class Consumed:
    """An NN worker's reply to PutBatch: every batch of `phase` up to stream index `through` is trained and its
    embedding update acknowledged (or, in evaluation, predicted), and every phase before `phase` has ended. The data loader forgets those batches; it
    keeps the rest to re-send should the rank be replaced (services/dataloader/delivery.py)."""

    phase: str = "train"
    through: int = -1
    incarnation: int = 0
    """The answering NN worker process (random, drawn at its start; 0: not said): a loader whose earlier frames
    went to another process of this rank sends its unconfirmed frames again."""

    def encode(self) -> bytes:
        return codec.encode(meta={"consumed_phase": self.phase, "through": int(self.through),
                                  "incarnation": int(self.incarnation)})

    @classmethod
    def decode(cls, buf: bytes) -> "Consumed":
        frame = codec.decode(buf)
        phase = frame.meta.get("consumed_phase")
        if phase not in PHASES:
            raise FrameError(f"consumed_phase must be one of {PHASES}, got {phase!r}")
        return cls(phase, frame.meta_int("through", default=-1), _count(frame, "incarnation", default=0))


@dataclass
class Received:
    """An NN worker's answer to a (re)started data loader: how far this rank holds that loader's stream of each
    phase. The loader's request is the same frame, empty but for `loader`.

    `through[phase]` is the last stream index the rank holds — received into its inbox or already trained by
    the group — or -1; the rank got every earlier batch of its share. `marks` are (stream index, position
    after it, samples of the phase sent to this rank through it) for the rank's latest training batches: the
    loader restarts reading after a round of batches whose end it finds there (services/dataloader/resume.py).
    """

    through: dict[str, int] = field(default_factory=lambda: {phase: -1 for phase in PHASES})
    ended: frozenset[str] = frozenset()
    marks: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)
    loader: int = 0
    """The data loader whose stream this is about (its index in cluster.dataloader)."""
    incarnation: int = 0
    """The answering NN worker process, as in `Consumed`."""
    past_training: bool = False
    """The rank has finished training (it is evaluating, or done): no loader's training frames can be owed."""

    def encode(self) -> bytes:
        seqs = np.array([m[0] for m in self.marks], np.int64)
        positions = np.array([m[1] for m in self.marks], np.int64).reshape(len(self.marks), POSITION_FIELDS)
        rows = np.array([m[2] for m in self.marks], np.int64)
        return codec.encode({"mark_seq": seqs, "mark_position": positions, "mark_rows": rows},
                            {"through": {k: int(v) for k, v in self.through.items()}, "ended": sorted(self.ended),
                             "loader": int(self.loader), "incarnation": int(self.incarnation),
                             "past_training": bool(self.past_training)})

    @staticmethod
    def loader_of(buf: bytes, loaders: int) -> int:
        """The data loader a `Received` request names; FrameError when it is not one of `loaders`."""
        loader = codec.decode(buf).meta_int("loader", default=0)
        if not 0 <= loader < loaders:
            raise FrameError(f"loader {loader} is not one of the {loaders} data loaders")
        return loader

    @classmethod
    def decode(cls, buf: bytes) -> "Received":
        frame = codec.decode(buf)
        through, ended = frame.meta.get("through"), frame.meta.get("ended")
        if (not isinstance(through, dict) or set(through) != set(PHASES)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= -1 for v in through.values())):
            raise FrameError(f"through must map each of {PHASES} to an index >= -1, got {through!r}")
        if not isinstance(ended, list) or not set(ended) <= set(PHASES):
            raise FrameError(f"ended must list phases of {PHASES}, got {ended!r}")
        seqs, rows = frame.get("mark_seq", np.int64, 1), frame.get("mark_rows", np.int64, 1)
        positions = frame.get("mark_position", np.int64, 2)
        if not (len(seqs) == len(rows) == positions.shape[0]) or positions.shape[1] != POSITION_FIELDS:
            raise FrameError(f"marks disagree: {len(seqs)} indices, {len(rows)} row counts, positions "
                             f"{positions.shape}")
        if (seqs < 0).any() or (rows < 0).any() or (positions < 0).any():
            raise FrameError("marks must be non-negative")
        marks = [(int(s), tuple(int(v) for v in p), int(r)) for s, p, r in zip(seqs, positions, rows)]
        past_training = frame.meta.get("past_training", False)
        if not isinstance(past_training, bool):
            raise FrameError(f"past_training must be true or false, got {past_training!r}")
        return cls(dict(through), frozenset(ended), marks, _count(frame, "loader", default=0),
                   _count(frame, "incarnation", default=0), past_training)


# -- embedding worker <-> PS shard -----------------------------------------------------------
def _ids_per_width(frame: codec.Frame, dims: Iterable[int]) -> dict[int, np.ndarray]:
    return {d: frame.get(f"ids.{d}", np.uint64, 1) for d in _per_width("ids", frame.tensors, dims)}


@dataclass
class PSLookup:
    """IDs a PS shard should look up, per width; `train` lookups may admit new IDs."""

    ids: dict[int, np.ndarray]  # width -> uint64 (n,)
    train: bool = False

    def encode(self) -> bytes:
        return codec.encode({f"ids.{d}": ids for d, ids in self.ids.items()}, {"train": self.train})

    @classmethod
    def decode(cls, buf: bytes, dims: Iterable[int], max_ids: int | None = None) -> "PSLookup":
        """`dims`: the widths this PS keeps; any other width is refused. `max_ids`: the most IDs a lookup may
        name, all widths together (`frames.max_ids`; None: not bounded)."""
        frame = codec.decode(buf)
        train = frame.meta.get("train", False)
        if not isinstance(train, bool):
            raise FrameError(f"train must be true or false, got {train!r}")
        ids = _ids_per_width(frame, dims)
        check_ids(sum(v.shape[0] for v in ids.values()), max_ids, "a lookup")
        return cls(ids, train)


@dataclass
class PSRows:
    """A PS shard's answer to `PSLookup`: one row per requested ID, per width."""

    rows: dict[int, np.ndarray]  # width -> float32 (n, width)

    def encode(self, values: ValueCodec) -> bytes:
        tensors: dict[str, np.ndarray] = {}
        for dim, rows in self.rows.items():
            tensors.update(values.pack(f"rows.{dim}", rows, dim))
        return codec.encode(tensors)

    @classmethod
    def decode(cls, buf: bytes, values: ValueCodec, expected: dict[int, int]) -> "PSRows":
        """`expected`: width -> number of IDs asked for; every one must come back."""
        frame = codec.decode(buf)
        return cls({d: _unpack(values, frame, f"rows.{d}", d, n) for d, n in expected.items()})


@dataclass
class PSUpdate:
    """Summed gradients of unique IDs, per width, for a PS shard's optimizer, under the update's id.

    `update_id` (see `update_id`) is the same in every re-send of one batch's
    update; a shard that has applied it answers the re-send without applying
    it again.
    """

    ids: dict[int, np.ndarray]  # width -> uint64 (n,) unique
    grads: dict[int, np.ndarray]  # width -> float32 (n, width)
    update_id: int

    def encode(self, values: ValueCodec) -> bytes:
        tensors: dict[str, np.ndarray] = {}
        for dim, ids in self.ids.items():
            tensors[f"ids.{dim}"] = ids
            tensors.update(values.pack(f"grads.{dim}", self.grads[dim], dim))
        return codec.encode(tensors, {"update_id": self.update_id})

    @classmethod
    def decode(cls, buf: bytes, values: ValueCodec, dims: Iterable[int], max_ids: int | None = None) -> "PSUpdate":
        """`max_ids`: as for `PSLookup.decode`."""
        frame = codec.decode(buf)
        uid = frame.meta_int("update_id")
        if not 0 < uid <= _U64:
            raise FrameError(f"update_id {uid} is not a non-zero uint64")
        ids = _ids_per_width(frame, dims)
        check_ids(sum(v.shape[0] for v in ids.values()), max_ids, "an update")
        grads = {}
        for dim, arr in ids.items():
            grads[dim] = _unpack(values, frame, f"grads.{dim}", dim, arr.shape[0])
            if _has_duplicates(arr):
                raise FrameError(f"the IDs of width {dim} of an update must be unique")
        return cls(ids, grads, uid)


# -- PS shard <-> its replica (ps.replicas: 2, services/embedding_ps/replica.py) -------------------------
COPIES = ("primary", "backup")
"""Which copy of a shard a `ShardPull` asks for: the shard itself, or the replica another PS keeps of it."""


def _text(frame: codec.Frame, key: str) -> str:
    value = frame.meta.get(key, "")
    if not isinstance(value, str) or len(value) > 256:
        raise FrameError(f"frame meta {key!r} must be a string of at most 256 characters, got {value!r:.80}")
    return value


def _count(frame: codec.Frame, key: str, *, default: int | None = None, limit: int = _U64) -> int:
    value = frame.meta_int(key, default=default)
    if not 0 <= value <= limit:
        raise FrameError(f"frame meta {key!r} must be in [0, {limit}], got {value}")
    return value


@dataclass
class ShardRows:
    """Whole rows of one PS shard (values and optimizer state), per width, and where they stand in the
    primary's history: `life` (services/embedding_ps/lives.py) and `seq`, that life's count of applied updates.

    Two uses: a replicated update (EmbeddingPS.Replicate request, primary -> backup: the rows update
    `update_id` changed, `seq` its number) and a page of a whole-shard copy (EmbeddingPS.PullShard reply:
    `seq` when the copy was taken, page `page` of `pages`, `copy_id` the copy's name for the later pages'
    requests; the last page carries `uids`, the update ids the shard remembers, oldest first)."""

    shard: int
    life: int
    seq: int
    rows: dict[int, tuple[np.ndarray, np.ndarray]]  # width -> (keys uint64 (n,), values float32 (n, row width))
    update_id: int = 0
    page: int = 0
    pages: int = 1
    uids: np.ndarray | None = None
    job: str = ""
    """The sender's `checkpoint.job_id`: a PS refuses rows of another job."""
    copy_id: int = 0

    def encode(self) -> bytes:
        tensors: dict[str, np.ndarray] = {}
        for dim, (keys, values) in self.rows.items():
            tensors[f"keys.{dim}"], tensors[f"values.{dim}"] = keys, values
        if self.uids is not None:
            tensors["uids"] = self.uids
        return codec.encode(tensors, {"shard": self.shard, "life": self.life, "seq": self.seq, "job": self.job,
                                      "update_id": self.update_id, "page": self.page, "pages": self.pages,
                                      "copy_id": self.copy_id})

    @classmethod
    def decode(cls, buf: bytes, row_widths: dict[int, int]) -> "ShardRows":
        """`row_widths`: width -> values per row (the width plus its optimizer state) of this PS's stores."""
        frame = codec.decode(buf)
        rows = {}
        for dim in _per_width("keys", frame.tensors, row_widths):
            keys, values = frame.get(f"keys.{dim}", np.uint64, 1), frame.get(f"values.{dim}", np.float32, 2)
            if values.shape != (keys.shape[0], row_widths[dim]):
                raise FrameError(f"values.{dim} has shape {values.shape}, expected {(keys.shape[0], row_widths[dim])}")
            rows[dim] = (keys, values)
        extra = set(frame.tensors) - {f"{k}.{d}" for d in rows for k in ("keys", "values")} - {"uids"}
        if extra:
            raise FrameError(f"unexpected tensors {sorted(extra)}")
        pages = _count(frame, "pages", default=1, limit=1 << 31)
        page = _count(frame, "page", default=0, limit=max(pages - 1, 0))
        uids = frame.get("uids", np.uint64, 1) if "uids" in frame.tensors else None
        return cls(_count(frame, "shard", limit=1 << 20), _count(frame, "life"), _count(frame, "seq"), rows,
                   _count(frame, "update_id", default=0), page, pages, uids, _text(frame, "job"),
                   _count(frame, "copy_id", default=0))


@dataclass
class ShardPull:
    """EmbeddingPS.PullShard request: page `page` of a copy of shard `shard` — its `copy` "primary" (a backup
    catching up), or the "backup" another PS keeps of it (a shard that lost its store, which names the lost
    `life`: only a copy of that life will do). Page 0 takes the copy and names it (`ShardRows.copy_id`); later
    pages name it back in `copy_id`, so that two readers at once each read their own copy."""

    shard: int
    copy: str
    page: int = 0
    life: int = 0
    job: str = ""
    """The asker's `checkpoint.job_id`: a PS gives no copy to another job."""
    copy_id: int = 0

    def encode(self) -> bytes:
        return codec.encode(meta={"shard": self.shard, "copy": self.copy, "page": self.page, "life": self.life,
                                  "job": self.job, "copy_id": self.copy_id})

    @classmethod
    def decode(cls, buf: bytes) -> "ShardPull":
        frame = codec.decode(buf)
        copy = frame.meta.get("copy")
        if copy not in COPIES:
            raise FrameError(f"copy must be one of {COPIES}, got {copy!r}")
        return cls(_count(frame, "shard", limit=1 << 20), copy, _count(frame, "page", default=0, limit=1 << 31),
                   _count(frame, "life", default=0), _text(frame, "job"), _count(frame, "copy_id", default=0))


FRAMES = (SparseBatch, BatchRef, DenseBatch, EndOfPhase, Embeddings, Gradients, Applied, Consumed, Received,
          PSLookup, PSRows, PSUpdate, ShardRows, ShardPull)
"""Every frame kind (docs and tests check they are all described)."""


def _has_duplicates(ids: np.ndarray) -> bool:
    from hybridrec.core.wire.dedup import has_duplicates  # numba: loaded where updates are decoded (the PS) only

    return has_duplicates(ids)
