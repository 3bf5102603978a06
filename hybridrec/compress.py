"""Wire compression of IDs and embedding values (DESIGN §3, Persia paper §4.2.3).

* IDs, lossless: a batch's ID list travels as its unique IDs plus a uint16
  position per occurrence, instead of one int64 per occurrence.
* Values, lossy: each vector is scaled by kappa/||v|| and cast to fp16; its norm
  goes along as float32 and the receiver scales back. Unlike a plain fp16 cast,
  this keeps ~11 bits of relative precision for tiny gradients (which a plain cast
  flushes to zero below 6e-8) and cannot overflow for large ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

    def unpack(self, tensors: dict[str, np.ndarray], name: str, vector_dim: int) -> np.ndarray:
        """float32 values from a frame's tensors (a writable array)."""
        values = tensors[name]
        if values.dtype == np.float32:
            return np.array(values)  # frombuffer views are read-only; torch wants writable memory
        if values.dtype != np.float16 or name + ".norm" not in tensors:
            raise ValueError(f"tensor {name!r}: expected float32, or float16 with {name}.norm")
        norms = tensors[name + ".norm"]
        if values.size % vector_dim or norms.dtype != np.float32 or norms.size != values.size // vector_dim:
            raise ValueError(f"tensor {name!r}: {values.size} values and {norms.size} norms do not make "
                             f"vectors of width {vector_dim}")
        return unscale_fp16(values.reshape(-1, vector_dim), norms.reshape(-1), self.kappa).reshape(values.shape)


def scaled_fp16(vectors: np.ndarray, kappa: float) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 vectors of norm kappa, float32 norms); zero vectors stay zero."""
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float32))
    scale = np.divide(np.float32(kappa), norms, out=np.ones_like(norms), where=norms > 0)
    half = np.empty(vectors.shape, dtype=np.float16)
    np.multiply(vectors, scale[:, None], out=half, casting="unsafe")
    return half, norms


def unscale_fp16(half: np.ndarray, norms: np.ndarray, kappa: float) -> np.ndarray:
    scale = norms / np.float32(kappa)
    out = np.empty(half.shape, dtype=np.float32)
    np.multiply(half, scale[:, None], out=out)
    # A zero vector was sent unscaled; its fp16 zeros times any norm are still zeros.
    return out


def dedup(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique IDs, uint16 position of each occurrence in the unique array)."""
    ids = np.asarray(ids, dtype=np.uint64)
    uniq, inverse = np.unique(ids, return_inverse=True)
    if uniq.size > MAX_UNIQUE:
        raise ValueError(f"{uniq.size} distinct IDs in one feature of one batch; at most {MAX_UNIQUE} fit "
                         f"uint16 positions: lower training.batch_size")
    return uniq, inverse.astype(np.uint16).reshape(-1)
