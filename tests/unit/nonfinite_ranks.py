"""What each spawned rank of tests/unit/test_nonfinite_step.py runs: two ranks, hybrid mode (DDP), where only
rank 1's step makes embedding gradients that are not finite (its loss and the reduced dense gradients are
finite): both ranks must skip that step alike, and stay equal.

Kept apart from the test module so the children import only what a step needs.
"""
from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import numpy as np

WORLD = 2
BATCH = 6


def _model():
    import torch

    class SqrtOfEmbeddings(torch.nn.Module):
        """Finite forward everywhere; sqrt(|x|) at x = 0 has no finite gradient, so a batch whose embeddings
        are zero makes embedding gradients that are not finite, and nothing else."""

        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3 + 4, 1)

        def forward(self, dense, embeddings):
            pooled = torch.sqrt(embeddings["a"].abs())
            return self.linear(torch.cat([dense, pooled], dim=1)).reshape(-1)

    return SqrtOfEmbeddings()


def _params(model) -> np.ndarray:
    import torch

    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def rank_main(rank: int, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    try:
        import torch
        import torch.distributed as dist

        from hybridrec.core.wire.compress import ValueCodec
        from hybridrec.core.config import from_dict
        from hybridrec.core.wire.frames import DenseBatch, Embeddings
        from hybridrec.core.wire.jagged import KeyedBags
        from hybridrec.core.model.pooling import Pooler
        from hybridrec.core.model.tasks import Tasks
        from services.nn_worker.group.distributed import DenseSync, DistEnv, open_groups
        from services.nn_worker.step import StepMath, make_dense_optimizer

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=60))
        timeout = datetime.timedelta(seconds=60)
        open_groups("gloo", store, rank=rank, world_size=WORLD, device=torch.device("cpu"), dense_timeout=timeout,
                    control_timeout=timeout)
        config = from_dict({"data": {"train": ["x"]}, "num_dense": 3, "features": [{"name": "a", "group": 0, "dim": 4}],
                            "training": {"compression": {"fp16": False}}, "optimizer": {"dense": {"name": "adam"}}})
        torch.manual_seed(0)
        model = _model()
        env = DistEnv(rank=rank, world_size=WORLD, backend="gloo", device=torch.device("cpu"))
        values = ValueCodec(fp16=False)
        math = StepMath(model, env, config.training, Tasks.from_config(config), Pooler(config.features, values))
        math.sync = DenseSync(model, env, config.training)
        math.optimizer = make_dense_optimizer(math.sync.module, config)
        rng = np.random.default_rng(rank)

        def batch(zero: bool):
            rows = np.zeros((2, 4), np.float32) if zero else rng.standard_normal((2, 4)).astype(np.float32) + 3
            frame = Embeddings(KeyedBags(rng.integers(0, 2, BATCH).astype(np.uint16), np.ones((1, BATCH), np.uint16)),
                               np.array([2], np.int32), {4: rows}).encode(values)
            dense = DenseBatch(1, rng.standard_normal((BATCH, 3)).astype(np.float32),
                               rng.integers(0, 2, BATCH).astype(np.float32))
            return dense, math.pooler.decode(frame, BATCH)

        record = {}
        first = math.train(*batch(zero=False), step=1)
        record["first_nonfinite"] = np.array(first.nonfinite)
        record["after_first"] = _params(model)
        state = {k: v.clone() for s in math.optimizer.state.values() for k, v in s.items()}
        second = math.train(*batch(zero=rank == 1), step=2)  # rank 1 alone: embedding gradients not finite
        record["second_nonfinite"] = np.array(second.nonfinite)
        record["second_loss"] = np.array(second.loss())
        record["after_second"] = _params(model)
        after = {k: v for s in math.optimizer.state.values() for k, v in s.items()}
        record["state_unchanged"] = np.array(all(torch.equal(state[k], after[k]) for k in state))
        third = math.train(*batch(zero=False), step=3)
        record["third_nonfinite"] = np.array(third.nonfinite)
        record["after_third"] = _params(model)
        dist.barrier()
        dist.destroy_process_group()
        np.savez(out / f"rank{rank}.npz", **record)
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(3)
