"""What each spawned rank of tests/unit/test_dense_sync.py runs.

Kept apart from the test module so the children import only torch, numpy and
the NN worker's distributed module (the test module's imports cost seconds more
per child on a loaded machine).
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import numpy as np

WORLD = 2
LR = 0.1
STEPS = 7
SYNC_INTERVAL = 3


def _params(model) -> np.ndarray:
    import torch

    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def _scenario(mode: str, env, rank: int, record: dict) -> None:
    """Build a model (seeded by rank), wrap it in DenseSync, train STEPS steps on rank-specific data."""
    import torch

    from hybridrec.core.config import TrainingConfig
    from services.nn_worker.group.distributed import DenseSync

    torch.manual_seed(1000 * rank + len(mode))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    record[f"{mode}/init"] = _params(model)
    sync = DenseSync(model, env, TrainingConfig(mode=mode, sync_interval=SYNC_INTERVAL))
    record[f"{mode}/start"] = _params(model)
    optimizer = torch.optim.SGD(sync.module.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(7 + rank)  # different data on each rank
    for step in range(1, STEPS + 1):
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
        if step == 1:  # this rank's own gradient, from the unwrapped model (no AllReduce)
            local = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), list(model.parameters()))
            record[f"{mode}/local_grad1"] = torch.cat([g.reshape(-1) for g in local]).numpy()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(sync.module(x), y).backward()
        optimizer.step()
        record[f"{mode}/pre{step}"] = _params(model)
        sync.after_step(step)
        record[f"{mode}/step{step}"] = _params(model)
    sync.finish()
    record[f"{mode}/finish"] = _params(model)


def rank_main(rank: int, port: int, out_dir: str) -> None:
    """Entry point of each spawned rank: results go to out_dir/rank{rank}.npz, a traceback to rank{rank}.err."""
    out = Path(out_dir)
    try:
        import torch
        import torch.distributed as dist

        from services.nn_worker.group.distributed import resolve_backend
        from services.nn_worker.group.membership import Fingerprint, Membership

        torch.set_num_threads(1)
        env = resolve_backend("gloo", rank, WORLD)  # auto on both branches: tests/unit/test_gpu_path.py
        plan = Membership(rank=rank, world_size=WORLD, rendezvous=f"127.0.0.1:{port}", backend=env.backend,
                          fingerprint=Fingerprint("test", WORLD, "test"), bind_host="127.0.0.1",
                          join_timeout_s=60, collective_timeout_s=60).join(step=None)
        assert plan.generation == 1 and plan.source is None and sorted(plan.joined_fresh) == list(range(WORLD))
        assert env.rank == rank and env.world_size == WORLD and env.backend == "gloo"
        assert env.device == torch.device("cpu")
        record: dict[str, np.ndarray] = {}
        for mode in ("hybrid", "sync", "async"):
            _scenario(mode, env, rank, record)
        dist.barrier()
        dist.destroy_process_group()
        np.savez(out / f"rank{rank}.npz", **record)
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(3)
