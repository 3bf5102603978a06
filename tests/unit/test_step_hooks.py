"""What the NN worker's training loop calls around each step (services/nn_worker/trainer.py): the staleness gate
(staleness.py), which lets a lookup start only while at most `staleness` updates are unacknowledged, and the
checkpointer, which is called after every step and decides itself whether to write (`Checkpointer.maybe_save`)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from hybridrec.core.config import from_dict
from services.nn_worker.checkpoint import AGREE_EVERY, Checkpointer
from services.nn_worker.staleness import StalenessGate


def test_the_gate_lets_a_lookup_start_only_within_the_bound():
    async def scenario():
        hist = np.zeros(3, np.int64)
        gate = StalenessGate(2, hist)
        for _ in range(3):  # staleness 2: three lookups may run ahead of their updates
            await gate.enter()
        assert gate.in_flight == 3 and list(hist) == [1, 1, 1]
        fourth = asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0)
        assert not fourth.done()  # waits for an acknowledgement
        gate.acknowledged()
        await fourth
        assert gate.in_flight == 3 and list(hist) == [1, 1, 2]  # it started with 2 outstanding
        for _ in range(3):
            gate.acknowledged()
        assert gate.in_flight == 0

    asyncio.run(scenario())


def test_the_checkpointer_decides_at_each_step_whether_to_write(tmp_path):
    """Every `interval_steps` steps it drains the trainer's pushes first and writes; with `interval_s` it asks
    the group every `AGREE_EVERY` steps whether the time is up (a collective), and at no other step."""
    config = from_dict({"data": {"train": ["t.tsv"]},
                        "checkpoint": {"dir": str(tmp_path), "interval_steps": 4, "interval_s": 60.0}})
    checkpointer = Checkpointer(config, 0, 1)
    events: list = []

    async def save(group, step, last, **_):
        events.append(("save", step))

    async def drained():
        events.append("drained")

    async def collective(fn, *args, after_regroup=None):
        events.append(("asked", fn.__name__))
        return True

    checkpointer.save = save
    group = SimpleNamespace(collective=collective)

    async def scenario():
        for step in range(1, AGREE_EVERY + 1):
            await checkpointer.maybe_save(group, step, [(step, (0, 0, 0, 0))], drained)

    asyncio.run(scenario())
    assert events == ["drained", ("save", 4), "drained", ("save", 8), ("asked", "time_up"), "drained",
                      ("save", AGREE_EVERY)]
