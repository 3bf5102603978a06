"""Wire compression of IDs and embedding values (Persia paper (Lian et al., KDD 2022) §4.2.3).

* IDs, lossless: a batch's ID list travels as its unique IDs plus a uint16
  position per occurrence, instead of one int64 per occurrence.
* Values, lossy: each vector is scaled by kappa/||v|| and cast to fp16; its norm
  goes along as float32 and the receiver scales back. Unlike a plain fp16 cast,
  this keeps ~11 bits of relative precision for tiny gradients (which a plain cast
  flushes to zero below 6e-8) and cannot overflow for large ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybridrec.core.runtime.lazy_torch import import_torch

MAX_UNIQUE = 65535


@dataclass(frozen=True)
class ValueCodec:
    """How float tensors are sent: kappa-scaled fp16, or plain float32 when fp16 is off."""

    fp16: bool = True
    kappa: float = 1024.0

    def pack(self, name: str, values: np.ndarray, vector_dim: int) -> dict[str, np.ndarray]:
        """Tensors to put in a frame for `values`, whose last axis splits into vectors of `vector_dim`."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not self.fp16:
            return {name: values}
        half, norms = scaled_fp16(values.reshape(-1, vector_dim), self.kappa)
        return {name: half.reshape(values.shape), name + ".norm": norms}

    def pack_tensors(self, name: str, values, vector_dim: int) -> dict:
        """`pack` of a torch tensor, on its device: the tensors to send, as torch tensors."""
        if not self.fp16:
            return {name: values.float()}
        half, norms = scaled_fp16_tensors(values.float().reshape(-1, vector_dim), self.kappa)
        return {name: half.reshape(values.shape), name + ".norm": norms}

    def unpack(self, tensors: dict[str, np.ndarray], name: str, vector_dim: int, *,
               keep_fp16: bool = False) -> "np.ndarray | Fp16Rows":
        """float32 values from a frame's tensors (a writable array); with `keep_fp16`, fp16 values stay as they
        came (`Fp16Rows`), to be scaled back where they are used: on a GPU, after a copy of half the bytes."""
        values = tensors[name]
        if values.dtype == np.float32:
            return np.array(values)  # frombuffer views are read-only; torch wants writable memory
        if values.dtype != np.float16 or name + ".norm" not in tensors:
            raise ValueError(f"tensor {name!r}: expected float32, or float16 with {name}.norm")
        norms = tensors[name + ".norm"]
        if values.size % vector_dim or norms.dtype != np.float32 or norms.size != values.size // vector_dim:
            raise ValueError(f"tensor {name!r}: {values.size} values and {norms.size} norms do not make "
                             f"vectors of width {vector_dim}")
        if keep_fp16:
            return Fp16Rows(values, norms.reshape(-1), self.kappa)
        return unscale_fp16(values.reshape(-1, vector_dim), norms.reshape(-1), self.kappa).reshape(values.shape)


class Fp16Rows(NamedTuple):
    """kappa-scaled fp16 vectors and their float32 norms, as a frame carried them, not yet scaled back."""

    half: np.ndarray  # float16 (n, width)
    norms: np.ndarray  # float32 (n,)
    kappa: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.half.shape

    @property
    def ndim(self) -> int:
        return self.half.ndim


def scaled_fp16(vectors: np.ndarray, kappa: float) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 vectors of norm kappa, float32 norms) of numpy vectors; zero vectors stay zero.

    torch does the arithmetic (`scaled_fp16_tensors`): its fp32<->fp16 casts use the CPU's F16C
    instructions, about 15x faster here than numpy's. Inputs and outputs are numpy arrays shared with torch
    without copies.
    """
    torch = import_torch()
    half, norms = scaled_fp16_tensors(torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)), kappa)
    return half.numpy(), norms.numpy()


def scaled_fp16_tensors(x, kappa: float):
    """`scaled_fp16` of a float torch tensor (n, width), on its device: the NN worker quantises its gradients
    where they are (a GPU copies half the bytes back)."""
    torch = import_torch()
    norms = torch.linalg.vector_norm(x, dim=1)
    scale = torch.where(norms > 0, kappa / norms, torch.ones_like(norms))
    return (x * scale[:, None]).to(torch.float16), norms


def unscale_fp16(half: np.ndarray, norms: np.ndarray, kappa: float) -> np.ndarray:
    """float32 vectors from kappa-scaled fp16 vectors and their norms."""
    torch = import_torch()
    h = torch.from_numpy(np.ascontiguousarray(half))
    n = torch.from_numpy(np.ascontiguousarray(norms, dtype=np.float32))
    return unscale(h, n, kappa).numpy()


def unscale(half, norms, kappa: float):
    """float32 torch vectors from kappa-scaled fp16 torch vectors and their norms, on their device (the NN
    worker scales rows back on its GPU: `Fp16Rows`). A zero vector was sent unscaled; its fp16 zeros times
    any norm are still zeros."""
    return half.float().mul_((norms / kappa)[:, None])


def check_unique_count(count: int) -> None:
    """Refuse a feature with more unique IDs in one batch than uint16 positions can address."""
    if count > MAX_UNIQUE:
        raise ValueError(f"{count} distinct IDs in one feature of one batch; at most {MAX_UNIQUE} fit "
                         f"uint16 positions: lower training.batch_size")
