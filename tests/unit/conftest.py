"""Fixtures shared by the unit tests."""
from __future__ import annotations

import pytest

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
