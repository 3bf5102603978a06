"""The correctness oracle: 1 NN worker, SGD for both parts, sync mode, fp32 on the wire.

hybridrec, through all four services, must end with the same parameters as a
plain single-process PyTorch model (embedding rows + the same MLP) fed the same
batches in the same order: every parameter within 1e-5 after 200 steps.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from hybridrec.core.config import load_config
from hybridrec.core.layouts.criteo_format import feature_columns
from hybridrec.core.model.models import FeatureInfo, build_model
from hybridrec.core.wire.sharding import shard_of
from services.dataloader.batching import ReadCounters, iter_train_batches
from services.embedding_ps.server import shard_dir
from services.embedding_ps.store import EmbeddingStore, StoreConfig, init_rows
from tests.conftest import HYBRIDREC, REPO, write_config

pytestmark = pytest.mark.integration

STEPS, BATCH, LR_EMB, LR_DENSE = 200, 256, 0.5, 0.05


def reference(config, steps: int):
    """Plain PyTorch: one embedding table over every ID seen, the same MLP, SGD, same batches in order."""
    columns, groups = feature_columns(config.features)
    batches = []
    for batch, _ in iter_train_batches(config.data.train, epochs=1, batch_size=config.training.batch_size,
                                       columns=columns, groups=groups, bad_lines="skip", counters=ReadCounters()):
        ids, present = batch.bags.to_columns()  # one ID or none per field
        batches.append((batch, ids, present))
        if len(batches) == steps:
            break
    vocab = np.unique(np.concatenate([ids[present] for _, ids, present in batches]))
    ps = config.ps
    dim = config.features[0].dim
    weight = torch.nn.Parameter(torch.from_numpy(init_rows(vocab, dim=dim, seed=config.training.seed,
                                                           distribution=ps.init.distribution,
                                                           scale=ps.init.scale).copy()))
    torch.manual_seed(config.training.seed)
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features],
                        config.num_dense, config.model.kwargs)
    opt_emb = torch.optim.SGD([weight], lr=LR_EMB)
    opt_dense = torch.optim.SGD(model.parameters(), lr=LR_DENSE)
    names = [f.name for f in config.features]
    for b, ids, present in batches:
        idx = torch.from_numpy(np.searchsorted(vocab, ids).astype(np.int64))
        mask = torch.from_numpy(present.astype(np.float32))
        rows = weight[idx] * mask[..., None]  # single-valued bags, sum pooling; a missing field is an empty bag
        embeddings = {n: rows[:, k] for k, n in enumerate(names)}
        logits = model(torch.from_numpy(np.array(b.dense)), embeddings).reshape(-1)
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(np.array(b.labels)))
        opt_emb.zero_grad()
        opt_dense.zero_grad()
        loss.backward()
        opt_emb.step()
        opt_dense.step()
    return vocab, weight.detach().numpy(), model.state_dict()


def test_sync_sgd_matches_single_process_pytorch(tmp_path, small_data):
    config_path = write_config(
        tmp_path / "oracle.yaml", small_data,
        training={"mode": "sync", "batch_size": BATCH, "max_steps": STEPS, "compression": {"fp16": False}},
        optimizer={"embedding": {"name": "sgd", "lr": LR_EMB}, "dense": {"name": "sgd", "lr": LR_DENSE}},
        cluster={"nn_workers": ["127.0.0.1:0"]},
        ps={"keep_shm": True, "capacity": 200_000, "shm_dir": str(tmp_path / "shm")},
    )
    run_dir = tmp_path / "run"
    result = subprocess.run(HYBRIDREC + ["run", str(config_path), "--run-dir", str(run_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = load_config(run_dir / "config.yaml")
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["max_steps"] == STEPS

    vocab, ref_rows, ref_dense = reference(load_config(config_path), STEPS)
    ours_dense = torch.load(run_dir / "dense_model.pt", weights_only=True)
    assert ours_dense.keys() == ref_dense.keys()
    for name, ref in ref_dense.items():
        torch.testing.assert_close(ours_dense[name], ref, rtol=0, atol=1e-5, msg=name)

    dim = config.features[0].dim
    num_shards = len(config.cluster.ps)
    rows = np.zeros_like(ref_rows)
    shards = shard_of(vocab, num_shards)
    for shard in range(num_shards):
        store = EmbeddingStore.open(shard_dir(config, shard) / f"dim-{dim}", StoreConfig.from_config(config, dim))
        try:
            mine = shards == shard
            rows[mine] = store.lookup(vocab[mine], train=False)
        finally:
            store.close()
    changed = np.abs(ref_rows - init_rows(vocab, dim=dim, seed=config.training.seed,
                                          distribution=config.ps.init.distribution, scale=config.ps.init.scale))
    assert changed.max() > 1e-3  # training moved the embeddings, so the comparison means something
    np.testing.assert_allclose(rows, ref_rows, rtol=0, atol=1e-5)
