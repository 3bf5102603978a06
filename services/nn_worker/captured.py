"""On a GPU: the training step as one CUDA graph over static, bucketed buffers (`training.capture`).

Why: at the README model's batch of 4,096 the eager step on a GPU issues a few hundred small kernels, and the
host issuing them (one process's interpreter) bounds the throughput while the GPU idles. A CUDA graph replays
the recorded kernels of a whole step with one launch. It replays fixed kernels on fixed addresses, so every
tensor the step reads has a fixed shape and place:

* A batch's shapes vary with what it holds: each width's unique rows (how many distinct IDs) and its bag
  elements (how many IDs in all: multi-hot features). Each is rounded up to a size of a short ladder
  (`bucket`), and the batch is padded to it. Padding rows are zeros; padding elements read the last row, a
  padding row, with weight 0, into a bag that is dropped (`Pooler.pool_padded`, which pools by a gather and an
  `index_add_`: the backward of `embedding_bag` reads a count back to the host on CUDA, which capture
  refuses). So the padded step computes what the eager step computes, and the padding rows' gradients, zeros,
  are dropped before the push. A batch larger
  than every bucket so far gets a larger one (a graph of its own), never a truncated batch.
* Each bucket (`_Graph`) has a `Layout`: where each padded array lies in one byte buffer. The host fills a
  pinned buffer with that layout and copies it, in one copy on the compute stream, into the bucket's static
  device buffer, whose views the graph reads. The graph's outputs (loss, logits, the non-finite flag, the
  packed gradients) are copied to the host after each replay, in stream order, before a later replay can
  overwrite them.
* A bucket's first `WARMUP` batches run the padded step eagerly (real steps, on a side stream, as capture
  asks); the next is captured, then replayed, and so is every later batch of the bucket.

The eager step (`StepMath.train`) stays the path on CPUs, for a lost batch, and wherever capture is refused:
several NN workers (DDP's AllReduce hooks and the replicas' averaging are not captured), a sequence feature
(its padded index has a shape of its own), a learning rate that falls with an optimizer that takes it only as
a number (Adam takes a tensor), more buckets than `MAX_GRAPHS`, or a model or loss whose capture fails (a
host synchronisation inside, say): one warning says why, once.

On a CPU, `CapturedStep(math, graphs=False)` runs the padded step without a graph: how the tests check that
the padding changes nothing.
"""
from __future__ import annotations

import math as _math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridrec.core.model.pooling import BatchEmbeddings, PaddedBags
from hybridrec.core.runtime import log
from hybridrec.core.wire import codec
from hybridrec.core.wire.compress import Fp16Rows, unscale
from hybridrec.core.wire.frames import DenseBatch, Gradients

LADDER_STEP = 256
"""Bucket sizes are multiples of this."""
GROWTH = 1.25
"""Each bucket size is at least this many times the one below it."""
WARMUP = 3
"""Eager padded steps of a bucket before it is captured."""
MAX_GRAPHS = 16
"""Buckets captured at most; a batch that needs another steps eagerly."""


def bucket(n: int) -> int:
    """The smallest size of the ladder (`LADDER_STEP`, then each at least `GROWTH` times the last, rounded up
    to a multiple of `LADDER_STEP`) that holds `n`."""
    size = LADDER_STEP
    while size < n:
        size = -(-_math.ceil(size * GROWTH) // LADDER_STEP) * LADDER_STEP
    return size


@dataclass(frozen=True)
class BucketKey:
    """A bucket: the batch's size, dense width and label shape and, per width (the pooler's `dims` order), its
    rows and its elements."""

    batch_size: int
    num_dense: int
    label_shape: tuple[int, ...]
    rows: tuple[int, ...]
    elements: tuple[int, ...]


class Layout:
    """Where each array of a padded batch lies in a bucket's byte buffer: the same offsets in the pinned host
    buffer and in the static device one."""

    def __init__(self, fields: list[tuple[str, np.dtype, tuple[int, ...]]]):
        self.fields: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        size = 0
        for name, dtype, shape in fields:
            dtype = np.dtype(dtype)
            self.fields[name] = (size, dtype, shape)
            size += codec.align(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        self.size = max(size, codec.ALIGN)

    def host_views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Each array as a numpy view of a uint8 host buffer of `size` bytes."""
        out = {}
        for name, (offset, dtype, shape) in self.fields.items():
            count = int(np.prod(shape, dtype=np.int64))
            out[name] = buffer[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
        return out

    def device_views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each array as a tensor view of a uint8 device buffer of `size` bytes."""
        out = {}
        for name, (offset, dtype, shape) in self.fields.items():
            count = int(np.prod(shape, dtype=np.int64))
            torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
            out[name] = buffer[offset:offset + count * dtype.itemsize].view(torch_dtype).view(shape)
        return out


class Padding:
    """How a batch is padded to its bucket: the bucket it needs (`key`), the bucket's `layout`, and the filling
    of a host buffer of that layout (`fill`). Knows the pooler's widths and features, nothing of torch."""

    def __init__(self, pooler):
        self.pooler, self.fp16 = pooler, pooler.values.fp16
        self.feats = {dim: np.asarray(pooler.pooled[dim], np.int64) for dim in pooler.dims}

    def key(self, batch: DenseBatch, emb: BatchEmbeddings) -> BucketKey:
        rows, elements = [], []
        for dim in self.pooler.dims:
            rows.append(bucket(_row_count(emb.rows[dim]) + 1))  # + the padding row, always there
            feats = self.feats[dim]
            elements.append(bucket(int((emb.start[feats + 1] - emb.start[feats]).sum())))
        return BucketKey(emb.batch_size, int(batch.dense.shape[1]), tuple(np.shape(batch.labels)[1:]), tuple(rows),
                         tuple(elements))

    def layout(self, key: BucketKey) -> Layout:
        fields: list[tuple[str, np.dtype, tuple[int, ...]]] = [
            ("dense", np.float32, (key.batch_size, key.num_dense)),
            ("labels", np.float32, (key.batch_size, *key.label_shape))]
        for dim, rows, elements in zip(self.pooler.dims, key.rows, key.elements):
            if self.fp16:
                fields += [(f"half.{dim}", np.float16, (rows, dim)), (f"norms.{dim}", np.float32, (rows,))]
            else:
                fields.append((f"f32.{dim}", np.float32, (rows, dim)))
            features = self.feats[dim].size
            fields += [(f"pos.{dim}", np.uint16, (elements,)), (f"counts.{dim}", np.int64, (features + 1,)),
                       (f"base.{dim}", np.int64, (features + 1,)),
                       (f"lengths.{dim}", np.uint16, (features, key.batch_size))]
        return Layout(fields)

    def fill(self, views: dict[str, np.ndarray], batch: DenseBatch, emb: BatchEmbeddings) -> dict[int, int]:
        """Write the batch, padded, into `views` (a buffer of its bucket's layout); returns each width's real
        row count (what is kept of its gradients)."""
        views["dense"][...] = batch.dense
        views["labels"][...] = batch.labels
        real = {}
        for dim in self.pooler.dims:
            rows = emb.rows[dim]
            real[dim] = _row_count(rows)
            if self.fp16:
                _head(views[f"half.{dim}"], rows.half)
                _head(views[f"norms.{dim}"], rows.norms)
            else:
                _head(views[f"f32.{dim}"], rows)
            self._fill_bags(views, dim, emb)
        return real

    def _fill_bags(self, views: dict[str, np.ndarray], dim: int, emb: BatchEmbeddings) -> None:
        """Width `dim`'s element positions (its features' in order, then zeros), the element count of each
        feature and of the padding, each feature's first row and the padding row's, and the bag lengths: a
        loop over the width's features, not its elements."""
        feats, pos, counts = self.feats[dim], views[f"pos.{dim}"], views[f"counts.{dim}"]
        at = 0
        for j, f in enumerate(feats):
            a, b = int(emb.start[f]), int(emb.start[f + 1])
            pos[at:at + b - a] = emb.pos[a:b]
            counts[j] = b - a
            at += b - a
        pos[at:] = 0
        counts[-1] = pos.shape[0] - at
        base = views[f"base.{dim}"]
        base[:-1] = emb.base[feats]
        base[-1] = views[f"half.{dim}" if self.fp16 else f"f32.{dim}"].shape[0] - 1
        views[f"lengths.{dim}"][...] = np.asarray(emb.lengths)[feats]


def _row_count(rows: "np.ndarray | Fp16Rows") -> int:
    return int((rows.half if isinstance(rows, Fp16Rows) else rows).shape[0])


def _head(view: np.ndarray, array: np.ndarray) -> None:
    """`array` at the start of `view` (along the first axis), zeros after it."""
    n = array.shape[0]
    view[:n] = array
    view[n:] = 0


class _Graph:
    """One bucket: its layout, its static device buffer and the views the step reads, the batches it has seen,
    and, once captured, the graph and its outputs."""

    def __init__(self, layout: Layout, device: torch.device):
        self.layout = layout
        self.buffer = torch.zeros(layout.size, dtype=torch.uint8, device=device)
        self.inputs = layout.device_views(self.buffer)
        self.runs = 0
        self.graph: "torch.cuda.CUDAGraph | None" = None
        self.outputs: tuple[dict, dict] | None = None  # (loss, logits, non-finite flag), packed gradients
        self.addresses: tuple[int, ...] = ()  # of the parameters and optimizer state the graph reads and writes


class CapturedStep:
    """`StepMath`'s training step as CUDA graphs, one per bucket (module docstring). `train` returns None where
    the step is not captured: the caller runs it eagerly."""

    def __init__(self, math, *, graphs: bool | None = None):
        self.math = math
        self.device = math.env.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.padding = Padding(math.pooler)
        self.buckets: dict[BucketKey, _Graph] = {}
        self._for: Any = None  # the optimizer the buckets were made for: another one (a re-formed group) drops them
        self._refused: str | None = None
        self._lr: dict[int, tuple[torch.Tensor, float]] = {}  # param group -> the rate its graphs read, its value
        self._said: set[str] = set()
        self._side = torch.cuda.Stream(self.device) if self.graphs else None

    def train(self, batch: DenseBatch, emb: BatchEmbeddings, step: int, out: Any = None):
        """Step `step` on `batch` through its bucket's graph; None (nothing done) where it is not captured."""
        if self.math.optimizer is not self._for:
            self.buckets.clear()
            self._lr.clear()
            self._for = self.math.optimizer
            self._refused = self.refusal()
        if self._refused is not None:
            self._say(self._refused)
            return None
        graph = self._bucket(self.padding.key(batch, emb))
        if graph is None:
            return None
        real = self._stage(graph, batch, emb)
        self._set_lr(step)
        outputs = self._run(graph)
        if outputs is None:
            return None
        head, packed = outputs
        return self.math.finish(batch, head, packed, out, real)

    def refusal(self) -> str | None:
        """Why this rank's step cannot be captured (None: it can)."""
        math = self.math
        if math.env.world_size > 1:
            return "several NN workers: DDP's AllReduce hooks and the replicas' averaging are not captured"
        if any(f.sequence for f in math.pooler.features):
            return "a sequence feature (pooling: none): its padded index is not bucketed"
        optimizer = math.optimizer
        adam = isinstance(optimizer, torch.optim.Adam)
        if adam and self.graphs and not all(g.get("capturable") for g in optimizer.param_groups):
            return "the dense Adam was not built capturable"
        if not adam and math.decay is not None and math.decay.falls:
            return (f"optimizer.dense.decay with {type(optimizer).__name__}: only Adam reads its learning rate "
                    f"from a tensor a graph can follow")
        return None

    def _bucket(self, key: BucketKey) -> _Graph | None:
        graph = self.buckets.get(key)
        if graph is None:
            if len(self.buckets) >= MAX_GRAPHS:
                self._say(f"more than {MAX_GRAPHS} buckets of batch shapes: the others step eagerly")
                return None
            graph = self.buckets[key] = _Graph(self.padding.layout(key), self.device)
        return graph

    def _stage(self, graph: _Graph, batch: DenseBatch, emb: BatchEmbeddings) -> dict[int, int]:
        """The padded batch into the bucket's device buffer: filled in pinned memory, one copy on the compute
        stream (ordered after the last replay, which read the buffer)."""
        host = torch.empty(graph.layout.size, dtype=torch.uint8, pin_memory=self.graphs)
        real = self.padding.fill(graph.layout.host_views(host.numpy()), batch, emb)
        graph.buffer.copy_(host, non_blocking=self.graphs)
        return real

    def _set_lr(self, step: int) -> None:
        """The step's learning rate (`LrDecay`, as the eager step sets it). Under graphs an Adam group reads it
        from a tensor on the device, filled when the rate changes; other optimizers keep a constant rate
        (`refusal`), which their graphs hold as a number."""
        optimizer, decay = self.math.optimizer, self.math.decay
        for i, group in enumerate(optimizer.param_groups):
            if decay is not None:
                value = float(decay.lr(step))
            elif i in self._lr and group["lr"] is self._lr[i][0]:  # the rate this class put there
                value = self._lr[i][1]
            else:
                value = float(group["lr"])
            if not (self.graphs and isinstance(optimizer, torch.optim.Adam)):
                group["lr"] = value
                continue
            tensor, last = self._lr.get(i, (None, None))
            if tensor is None:
                tensor = torch.tensor(value, dtype=torch.float32, device=self.device)
            elif value != last:
                tensor.fill_(value)
            self._lr[i] = (tensor, value)
            group["lr"] = tensor

    def _run(self, graph: _Graph) -> tuple[dict, dict] | None:
        """The padded step on the bucket's inputs: replayed, captured (after `WARMUP` eager runs) or eager. A
        graph whose parameters or optimizer state moved since its capture (a state loaded into the optimizer
        replaces its tensors) is captured again."""
        if graph.graph is not None and graph.addresses != self._addresses():
            graph.graph, graph.outputs, graph.runs = None, None, WARMUP
        if graph.graph is not None:
            graph.graph.replay()
            return graph.outputs
        if not self.graphs:
            return self.compute(graph.inputs)
        if graph.runs < WARMUP:
            graph.runs += 1
            return self._on_side_stream(graph.inputs)
        return self._capture(graph)

    def _on_side_stream(self, inputs: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """An eager padded step on a side stream, as warm-up before a capture asks (lazily made handles and
        workspaces are made there, not in the graph)."""
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            outputs = self.compute(inputs)
        current.wait_stream(self._side)
        return outputs

    def _capture(self, graph: _Graph) -> tuple[dict, dict] | None:
        """Capture the bucket's step and replay it (capture runs nothing). Other threads' CUDA calls (the copy
        waiter's) stay legal meanwhile ("thread_local"). A failed capture refuses capture from then on."""
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cuda_graph, capture_error_mode="thread_local"):
                outputs = self.compute(graph.inputs)
        except Exception as exc:  # noqa: BLE001 - the step runs eagerly instead, and the warning says why
            self._refused = f"capture failed: {type(exc).__name__}: {exc}"
            self.buckets.clear()
            self._say(self._refused)
            return None
        graph.graph, graph.outputs, graph.addresses = cuda_graph, outputs, self._addresses()
        cuda_graph.replay()
        return outputs

    def _addresses(self) -> tuple[int, ...]:
        """Where the dense parameters and the optimizer's state tensors are (a graph holds these addresses)."""
        optimizer = self.math.optimizer
        out = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                out.append(param.data_ptr())
                out.extend(v.data_ptr() for v in optimizer.state.get(param, {}).values()
                           if isinstance(v, torch.Tensor))
        return tuple(out)

    def compute(self, inputs: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """The padded step's math on a bucket's inputs: pooling, forward, loss, backward, the non-finite check,
        the optimizer, the gradients' packing; returns what goes to the host: (loss, logits and the non-finite
        flag by name, the packed gradients)."""
        math, dims = self.math, self.padding.pooler.dims
        kappa = math.pooler.values.kappa
        rows = {d: (unscale(inputs[f"half.{d}"], inputs[f"norms.{d}"], kappa) if self.padding.fp16
                    else inputs[f"f32.{d}"].detach()) for d in dims}
        bags = {d: PaddedBags(inputs[f"pos.{d}"], inputs[f"counts.{d}"], inputs[f"base.{d}"],
                              inputs[f"lengths.{d}"]) for d in dims}
        batch_size = inputs["dense"].shape[0]
        leaves, embeddings = math.pooler.pool_padded(rows, bags, batch_size)
        with math.autocast(cache_enabled=False):
            logits = math.logits(math.model(inputs["dense"], embeddings))
        loss = math.loss(logits, inputs["labels"])
        math.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = {d: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for d, leaf in leaves.items()}
        found = math.nonfinite(loss, grads)
        math.optimizer.found_inf = found.view(())
        math.optimizer.step()
        packed = Gradients.pack_tensors(math.pooler.values, grads)
        return {"loss": loss.detach(), "logits": logits.detach(), "nonfinite": found}, packed

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            log.get("nn_worker").warning("step_not_captured", why=why, rank=self.math.env.rank)
