"""On the NN worker: a batch's host arrays to the rank's device, and its embedding gradients back.

On the CPU both directions are free (tensors share the numpy arrays' memory; fp16 rows are scaled back by
the pooler on the compute thread). On a GPU the host only moves bytes:

* `stage` packs the batch — dense values, labels, the frame's fp16 rows and their norms, positions and bag
  lengths (uint16, as they came), each feature's first row, a sequence's padded index — into one pinned
  buffer (torch's caching host allocator keeps it) and copies it to the device in one `non_blocking` copy,
  on a side stream with `training.overlap_copies` (the default), so the copy runs while the GPU still
  computes the previous step; the compute stream then waits for it on the GPU (`wait_stream`), not the
  host. Every array is a view of the device buffer; the rows are scaled back, and the pooler's index and
  offsets built, by kernels on the device (`hybridrec.core.model.pooling`).
* `to_host` copies the step's outputs (κ-scaled fp16 gradients and their norms, quantised on the device by
  `hybridrec.core.wire.compress.scaled_fp16_tensors`; the loss; the logits) into pinned memory on the compute stream
  and records an event; the gradient push awaits that event (`ready`) on the event loop, so the compute
  thread goes on to the next step.

Without overlap (`training.overlap_copies: false`, the benchmark's baseline), the copies are synchronous.
"""
from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hybridrec.core.wire import codec
from hybridrec.core.wire.compress import Fp16Rows
from hybridrec.core.model.pooling import BatchEmbeddings



class DeviceFeed:
    def __init__(self, device: torch.device, *, overlap: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.overlap = overlap and self.cuda
        self.stream = torch.cuda.Stream(device) if self.overlap else None

    # -- host to device ----------------------------------------------------------------------------
    def stage(self, dense: np.ndarray, labels: np.ndarray | None,
              emb: BatchEmbeddings) -> tuple[torch.Tensor, torch.Tensor | None, BatchEmbeddings]:
        """Compute thread: the batch on the device (`emb` with tensors in place of its arrays; no labels when
        None: evaluation needs none there); the compute stream is ordered after the copy."""
        if not self.cuda:
            return _writable(dense), None if labels is None else _writable(labels), emb
        arrays = _arrays(dense, labels, emb)
        pinned, offsets = _pack(arrays)
        if not self.overlap:
            return _unpack(pinned.to(self.device), offsets, arrays, emb)
        with torch.cuda.stream(self.stream):
            buffer = pinned.to(self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        buffer.record_stream(current)  # the allocator must not reuse it before the compute stream is done
        return _unpack(buffer, offsets, arrays, emb)

    # -- device to host ----------------------------------------------------------------------------
    def to_host(self, tensors: dict) -> tuple[dict, "torch.cuda.Event | None"]:
        """Compute thread: `tensors` (name -> tensor) on the host, and the event after which they hold their
        values (None: they already do)."""
        if not self.cuda:
            return {k: t.detach() for k, t in tensors.items()}, None
        if not self.overlap:
            return {k: t.detach().cpu() for k, t in tensors.items()}, None
        out = {}
        for key, tensor in tensors.items():
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            pinned.copy_(tensor.detach(), non_blocking=True)
            out[key] = pinned
        event = torch.cuda.Event(blocking=True)  # its waiter sleeps until the copy is done, it does not spin
        event.record()
        return out, event


def _writable(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor of `array`, copied only when it is a read-only view of a received frame (a few hundred kB)."""
    return torch.from_numpy(array if array.flags.writeable else np.array(array))


def _arrays(dense: np.ndarray, labels: np.ndarray | None, emb: BatchEmbeddings) -> dict[str, np.ndarray]:
    """Every host array of a batch that the device needs, by name."""
    out = {"dense": dense, "pos": emb.pos, "bag_lengths": emb.lengths, "base": emb.base}
    if labels is not None:
        out["labels"] = labels
    for dim, rows in emb.rows.items():
        if isinstance(rows, Fp16Rows):
            out[f"half.{dim}"], out[f"norms.{dim}"] = rows.half, rows.norms
        else:
            out[f"f32.{dim}"] = rows
    for f, (index, lengths) in emb.sequences.items():
        out[f"seq.{f}"], out[f"seqlen.{f}"] = index, lengths
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _pack(arrays: dict[str, np.ndarray], *, pin: bool = True) -> tuple[torch.Tensor, dict[str, int]]:
    """One pinned byte buffer holding every array at an aligned offset: the batch's single host→device copy."""
    offsets, size = {}, 0
    for name, array in arrays.items():
        offsets[name] = size
        size += codec.align(array.nbytes)
    pinned = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pin)
    host = pinned.numpy()
    for name, array in arrays.items():
        host[offsets[name]:offsets[name] + array.nbytes] = array.reshape(-1).view(np.uint8)
    return pinned, offsets


def _unpack(buffer: torch.Tensor, offsets: dict[str, int], arrays: dict[str, np.ndarray],
            emb: BatchEmbeddings) -> tuple[torch.Tensor, torch.Tensor | None, BatchEmbeddings]:
    """The arrays as views of the device buffer, back in the batch's shape."""
    def view(name: str) -> torch.Tensor:
        array = arrays[name]
        dtype = torch.from_numpy(np.empty(0, array.dtype)).dtype
        part = buffer[offsets[name]:offsets[name] + array.nbytes]
        return part.view(dtype).view(array.shape)

    rows = {}
    for dim, host_rows in emb.rows.items():
        rows[dim] = (Fp16Rows(view(f"half.{dim}"), view(f"norms.{dim}"), host_rows.kappa)
                     if isinstance(host_rows, Fp16Rows) else view(f"f32.{dim}"))
    staged = dataclasses.replace(emb, rows=rows, pos=view("pos"), lengths=view("bag_lengths"),
                                 device_base=view("base"),
                                 sequences={f: (view(f"seq.{f}"), view(f"seqlen.{f}")) for f in emb.sequences})
    return view("dense"), view("labels") if "labels" in arrays else None, staged


_waiter: ThreadPoolExecutor | None = None


async def ready(event: "torch.cuda.Event | None") -> None:
    """Event loop: wait until a `to_host` copy is complete, without blocking the loop or the compute thread:
    a thread of its own sleeps in the event's synchronisation and wakes the loop once (polling the event from
    the loop every few hundred microseconds cost the loop's thread a wake-up each time)."""
    global _waiter
    if event is None or event.query():
        return
    if _waiter is None:
        _waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-wait")
    await asyncio.get_running_loop().run_in_executor(_waiter, event.synchronize)
