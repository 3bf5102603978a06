"""The data side of the single-process baselines (benchmarks/baselines.py).

Kept apart from the models and the training loop because both baselines (and
anything that wants to time them) need the very same in-memory data: Criteo
files read with hybridrec's own ``read_criteo`` (so the baselines see exactly
what hybridrec sees), cached per process so a driver running several baselines
reads them once, hashed into the tables (row = id % table_rows) before the
clock starts, and cut into TorchRec's feature-major jagged layout with a few
vectorised tensor ops.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hybridrec.core.wire.ids import GROUP_SHIFT
from services.dataloader.tsv import NUM_SPARSE, read_criteo

FEATURES = [f"C{i + 1}" for i in range(NUM_SPARSE)]
READ_CHUNK_ROWS = 1 << 18


@dataclass
class Arrays:
    """A Criteo file (or several) in memory, as read_criteo gives it."""

    labels: np.ndarray  # float32 (n,)
    dense: np.ndarray  # float32 (n, 13), log1p
    ids: np.ndarray  # uint64 (n, 26), group in the top 8 bits
    present: np.ndarray  # bool (n, 26)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


_CACHE: dict[tuple, Arrays] = {}


def _key(paths: Sequence[str | os.PathLike]) -> tuple:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((os.path.abspath(p), st.st_size, st.st_mtime_ns))
    return tuple(out)


def load(paths: str | os.PathLike | Sequence[str | os.PathLike], *, cache: bool = True) -> Arrays:
    """Read Criteo files (or directories prepared from them) with hybridrec's readers into one set of arrays.

    Kept in a small per-process cache (keyed by path, size and mtime) so that a
    driver running several baselines over the same files reads them once.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    key = _key(paths)
    if cache and key in _CACHE:
        return _CACHE[key]
    chunks = [c for p in paths for c in (_prepared_rows(p) if os.path.isdir(p)
                                         else read_criteo(p, chunk_rows=READ_CHUNK_ROWS))]
    if not chunks or sum(len(c) for c in chunks) == 0:
        raise ValueError(f"no samples in {list(map(str, paths))}")
    arrays = Arrays(*(np.concatenate([getattr(c, k) for c in chunks])
                      for k in ("labels", "dense", "ids", "present")))
    if cache:
        if len(_CACHE) >= 4:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = arrays
    return arrays


def _prepared_rows(directory: str | os.PathLike):
    """The rows of a directory `hybridrec data prepare` wrote from Criteo TSV (the default 26 features),
    checked as the data loader checks it: the same hashed IDs and transformed dense values as `read_criteo`."""
    from hybridrec.core.config import Config
    from services.dataloader.batching import ReadCounters
    from services.dataloader.prepared import iter_rows

    config = Config.model_validate({"data": {"train": [str(directory)]}, "cluster": {"ps": ["127.0.0.1:1"]}})
    absent = np.arange(NUM_SPARSE, dtype=np.uint64) << np.uint64(GROUP_SHIFT)  # as read_criteo leaves an empty field
    return [Arrays(rows.labels, rows.dense, *rows.bags.to_columns(absent))
            for rows in iter_rows([str(directory)], config, counters=ReadCounters())]


def clear_cache() -> None:
    _CACHE.clear()


@dataclass
class Tensors:
    """Model-ready tensors: row indices already hashed into the tables."""

    labels: torch.Tensor  # float32 (n,)
    dense: torch.Tensor  # float32 (n, 13)
    idx: torch.Tensor  # int64 (n, 26): id % table_rows
    present: torch.Tensor  # bool (n, 26)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device) -> "Tensors":
        """The same tensors on `device`: a GPU baseline indexes its whole data set there, so no batch is
        copied from the host while the clock runs."""
        return Tensors(*(t.to(device) for t in (self.labels, self.dense, self.idx, self.present)))


def to_tensors(a: Arrays, table_rows: int) -> Tensors:
    idx = (a.ids % np.uint64(table_rows)).astype(np.int64)
    return Tensors(torch.from_numpy(a.labels), torch.from_numpy(a.dense), torch.from_numpy(idx),
                   torch.from_numpy(a.present))


def jagged(idx: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of a batch in feature-major (KeyedJaggedTensor) order.

    values: the present row indices of feature 0 for every sample, then feature 1, ...;
    lengths: int64 (26 * B,), lengths[f * B + b] = 1 if feature f of sample b is present else 0.
    """
    pt = present.t()
    return idx.t()[pt], pt.reshape(-1).to(torch.int64)


def _prepare(train_paths, eval_paths, table_rows: int) -> tuple[Tensors, Tensors]:
    return to_tensors(load(train_paths), table_rows), to_tensors(load(eval_paths), table_rows)
