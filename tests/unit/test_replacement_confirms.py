"""A replacement NN worker confirms to its data loader only what it was sent (services/nn_worker/ledger.py):
the batches its predecessor trained but whose embedding updates died with it must reach it again, so a loader
may forget a batch only once the replacement has settled it (or trained a later one)."""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from hybridrec.core.config import from_dict
from hybridrec.core.wire.frames import DenseBatch, EndOfPhase
from hybridrec.core.model.models import FeatureInfo, build_model
from services.nn_worker.group.distributed import DistEnv
from services.nn_worker.routing import BatchLost
from services.nn_worker.compute import ComputeThread
from services.nn_worker.trainer import Trainer


def _replacement(lookup) -> Trainer:
    config = from_dict({"data": {"train": ["x"]}, "num_dense": 3,
                        "features": [{"name": "a", "group": 0, "dim": 4}],
                        "cluster": {"nn_workers": ["a:1", "b:2"]}})
    model = build_model(config.model.path, [FeatureInfo(f.name, f.dim) for f in config.features], config.num_dense,
                        config.model.kwargs)
    env = DistEnv(rank=0, world_size=2, backend="gloo", device=torch.device("cpu"))
    trainer = Trainer(config, env, model, lookup, None, asyncio.Queue(), ComputeThread())
    trainer.group.take_over([7])  # the group trained 7 steps: this rank's batches 0, 2, ..., 12; its next is 14
    return trainer


def _batch(seq: int, rows_before: int = 0) -> DenseBatch:
    return DenseBatch(1000 + seq, np.zeros((10, 3), np.float32), np.zeros(10, np.float32), seq=seq,
                      position=(0, 0, seq, 1), rows_before=rows_before)


def test_a_replacement_confirms_what_it_settled_not_the_groups_state():
    async def scenario():
        async def applied_already(ref):  # the predecessor's updates reached the PS before it died
            raise BatchLost(f"batch {ref} is not held")

        trainer = _replacement(applied_already)
        assert trainer.ledger.consumed(0).through == -1  # not 12: the loader keeps every frame it has not re-sent
        for seq in (0, 2, 4):  # the loader's window, sent again oldest first
            assert not trainer._in_sequence(_batch(seq))
            assert trainer.ledger.consumed(0).through == max(seq - 2, -1)  # this one confirmed only once settled
            await asyncio.gather(*trainer._replays)
            assert trainer.ledger.consumed(0).through == seq
        assert trainer.ledger.consumed(0).through == 4  # 6..12 not yet re-sent: still owed, still kept by the loader
        assert trainer._in_sequence(_batch(14))  # the first batch of its own
        assert trainer.stats.replayed_dropped == 3

    asyncio.run(scenario())


def test_a_replacement_counts_its_predecessors_share_once_as_it_takes_a_loaders_last_batch_and_end():
    """The prefetcher can take a loader's last batch and its end before the step trains that batch: the
    predecessor's share (the samples sent the rank before the batch) is counted once, as the batch is taken."""
    async def scenario():
        trainer = _replacement(None)
        inbox_items = [_batch(14, rows_before=70), EndOfPhase("train", {}, end_seq=16, rows_sent=80)]

        async def get(loader):
            return inbox_items.pop(0)

        trainer.inbox.get = get
        assert not trainer.group.samples_counted  # an interval checkpoint now would be postponed (checkpoint.py)
        assert (await trainer._take("train")).seq == 14
        assert trainer.group.samples_counted
        assert await trainer._take("train") is None  # the end: every loader ended
        assert trainer.stats.samples == 70  # the predecessor's 7 batches; batch 14's own 10 when it is trained

    asyncio.run(scenario())
