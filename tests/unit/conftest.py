"""Fixtures shared by the unit tests."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from services.nn_worker.group.distributed import close_groups, open_groups

from services.embedding_ps.store import EmbeddingStore, StoreConfig


@pytest.fixture
def open_store(tmp_path):
    """Open embedding stores under tmp_path (`open_store(config, name)`) and close them all at the end."""
    opened = []

    def _open(cfg: StoreConfig, name: str = "store") -> EmbeddingStore:
        store = EmbeddingStore.open(tmp_path / name, cfg)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@pytest.fixture
def group_of_one(tmp_path):
    """A real Gloo group of one rank (`open_groups`), for a real `DenseSync`."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    timeout = datetime.timedelta(seconds=30)
    open_groups("gloo", store, rank=0, world_size=1, device=torch.device("cpu"), dense_timeout=timeout,
                control_timeout=timeout)
    yield
    close_groups()
