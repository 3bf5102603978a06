"""On the NN worker: a batch's host arrays to the rank's device, and its embedding gradients back.

On the CPU both directions are free (tensors share the numpy arrays' memory).
On a GPU, with `training.overlap_copies` (the default), nothing in a step
makes the host wait for the device:

* `stage` copies a batch's dense values, labels and embedding arrays from
  pinned host memory (torch's caching host allocator keeps it) on a side
  stream, `non_blocking`, so the copy runs while the GPU still computes the
  previous step; fp16 rows cross as fp16 and are scaled back on the GPU
  (`hybridrec.compress.Fp16Rows`, half the bytes). The compute stream then
  waits for the copy on the GPU (`wait_stream`), not the host.
* `to_host` copies the gradients (and the loss) into pinned memory on the
  compute stream and records an event; the gradient push awaits that event
  (`ready`) on the event loop, so the compute thread goes on to the next step.

Without overlap (`training.overlap_copies: false`, the benchmark's baseline),
copies are synchronous `.to(device)` / `.cpu()` calls, as before.
"""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import torch

from hybridrec.compress import Fp16Rows, unscale
from hybridrec.pooling import BatchEmbeddings

EVENT_POLL_S = 0.0002
"""How often the event loop looks whether a step's gradients have reached the host (a step takes milliseconds)."""


class DeviceFeed:
    def __init__(self, device: torch.device, *, overlap: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.overlap = overlap and self.cuda
        self.stream = torch.cuda.Stream(device) if self.overlap else None
        self._copied: list[torch.Tensor] = []

    # -- host to device ----------------------------------------------------------------------------
    def stage(self, dense: np.ndarray, labels: np.ndarray | None,
              emb: BatchEmbeddings) -> tuple[torch.Tensor, torch.Tensor | None, BatchEmbeddings]:
        """Compute thread: the batch on the device (`emb` with tensors in place of its arrays; no labels when
        None: evaluation needs none there); the compute stream is ordered after the copies."""
        if not self.cuda:
            return (torch.from_numpy(np.asarray(dense)), None if labels is None else torch.from_numpy(labels),
                    emb)
        if self.overlap:
            with torch.cuda.stream(self.stream):
                staged = self._stage(dense, labels, emb)
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for tensor in self._copied:  # the allocator must not reuse them before the compute stream is done
                tensor.record_stream(current)
            self._copied.clear()
            return staged
        return self._stage(dense, labels, emb)

    def _stage(self, dense, labels, emb: BatchEmbeddings):
        return self._copy(dense), None if labels is None else self._copy(labels), dataclasses.replace(
            emb, rows={d: self._rows(r) for d, r in emb.rows.items()},
            index={d: self._copy(a) for d, a in emb.index.items()},
            offsets={d: self._copy(a) for d, a in emb.offsets.items()},
            weights={d: None if a is None else self._copy(a) for d, a in emb.weights.items()},
            sequences={f: (self._copy(i), self._copy(n)) for f, (i, n) in emb.sequences.items()})

    def _rows(self, rows: np.ndarray | Fp16Rows) -> torch.Tensor:
        if isinstance(rows, Fp16Rows):  # scaled back on the device (on the side stream, with the copy)
            out = unscale(self._copy(rows.half), self._copy(rows.norms), rows.kappa)
            if self.overlap:
                self._copied.append(out)  # made on the side stream too: see record_stream in stage
            return out
        return self._copy(rows)

    def _copy(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if not self.overlap:
            return host.to(self.device)
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        out = pinned.to(self.device, non_blocking=True)
        self._copied.append(out)
        return out

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
        event = torch.cuda.Event()
        event.record()
        return out, event


async def ready(event: "torch.cuda.Event | None") -> None:
    """Event loop: wait until a `to_host` copy is complete, without blocking the loop or the compute thread."""
    while event is not None and not event.query():
        await asyncio.sleep(EVENT_POLL_S)
