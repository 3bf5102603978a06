"""The order in which every NN rank takes the data loaders' batches (services/nn_worker/inbox.py)."""
from __future__ import annotations

import asyncio

import numpy as np

from hybridrec.core.wire.frames import DenseBatch, EndOfPhase
from services.nn_worker.inbox import Inbox, merge_ends, next_loader


def _steps(batches_per_loader: list[int], ranks: int) -> list[list[tuple[int, int]]]:
    """Each rank's (loader, seq) per step when loader l deals batches_per_loader[l] rounds evenly."""
    out = []
    for rank in range(ranks):
        taken, ended, steps = [rank] * len(batches_per_loader), set(), []
        while (loader := next_loader(taken, ended)) is not None:
            if taken[loader] >= batches_per_loader[loader] * ranks:  # its end comes next
                ended.add(loader)
                continue
            steps.append((loader, taken[loader]))
            taken[loader] += ranks
        out.append(steps)
    return out


def test_loaders_take_turns_and_a_finished_one_leaves_the_turn_on_every_rank_alike():
    per_rank = _steps([3, 1, 2], ranks=2)
    assert [loader for loader, _ in per_rank[0]] == [0, 1, 2, 0, 2, 0]
    assert [[loader for loader, _ in steps] for steps in per_rank] == [[0, 1, 2, 0, 2, 0]] * 2
    assert per_rank[1][0] == (0, 1) and per_rank[0][3] == (0, 2)  # rank r gets r, r + N, ... of each stream
    for counts in ([5, 5, 5], [0, 4, 1], [7], [2, 0, 0, 3]):
        steps = _steps(counts, ranks=3)
        assert len({tuple(loader for loader, _ in s) for s in steps}) == 1  # one order for every rank
        assert len(steps[0]) == sum(counts)


def test_the_order_resumes_from_the_counts_alone():
    """A checkpoint or a hand-over carries only the batches taken per loader: the order goes on the same."""
    counts, ranks = [4, 2, 3], 2
    full = _steps(counts, ranks)[1]
    taken = [ranks * sum(1 for loader, _ in full[:5] if loader == l) + 1 for l in range(3)]
    ended = {l for l in range(3) if taken[l] >= counts[l] * ranks}
    rest = []
    while (loader := next_loader(taken, ended)) is not None:
        if taken[loader] >= counts[loader] * ranks:
            ended.add(loader)
            continue
        rest.append((loader, taken[loader]))
        taken[loader] += ranks
    assert rest == full[5:]


def test_ends_are_merged_into_the_runs_counters():
    one = {0: EndOfPhase("train", {"rows": 5, "bad_lines": 1, "first_seq": 4})}
    assert merge_ends(one) == {"rows": 5, "bad_lines": 1, "first_seq": 4}
    many = {1: EndOfPhase("train", {"rows": 7, "bad_lines": 0}, loader=1),
            0: EndOfPhase("train", {"rows": 5, "bad_lines": 1, "first_seq": 4})}
    assert merge_ends(many) == {"rows": 12, "bad_lines": 1, "loaders": [{"rows": 5, "bad_lines": 1, "first_seq": 4},
                                                                      {"rows": 7, "bad_lines": 0}]}


def _batch(loader: int, seq: int) -> DenseBatch:
    return DenseBatch(seq, np.zeros((1, 2), np.float32), np.zeros(1, np.float32), "eval", seq=seq, loader=loader)


def test_eval_frames_are_taken_from_whichever_loader_has_one():
    async def scenario():
        inbox = Inbox(3, maxsize=2)
        waiting = asyncio.ensure_future(inbox.get_any([0, 1, 2]))
        await asyncio.sleep(0)
        assert not waiting.done()
        await inbox.put(_batch(2, 0))
        assert (await waiting).loader == 2
        await inbox.put(_batch(1, 0))
        await inbox.put(_batch(0, 0))
        got = [await inbox.get_any([0, 1]), await inbox.get_any([0, 1])]
        assert sorted(b.loader for b in got) == [0, 1] and inbox.qsize() == 0
        put = asyncio.ensure_future(asyncio.gather(*(inbox.put(_batch(1, s)) for s in range(3))))
        await asyncio.sleep(0)
        assert inbox.qsize() == 2 and not put.done()  # a full queue pushes back on its own loader only
        await inbox.put(_batch(0, 1))
        assert (await inbox.get(1)).seq == 0
        await put

    asyncio.run(scenario())


def test_a_put_that_need_not_wait_is_taken_at_once_and_never_overtakes_one_that_waits():
    """`put_nowait` (the receiver's batches, admitted without a coroutine) queues only while the loader's queue
    has room and no earlier put of that loader waits for it; otherwise it leaves the batch to `put`."""
    def batch(seq: int, loader: int = 0) -> DenseBatch:
        return DenseBatch(seq, np.zeros((1, 1), np.float32), np.zeros(1, np.float32), seq=seq, loader=loader)

    async def scenario():
        inbox = Inbox(loaders=2, maxsize=2)
        assert inbox.put_nowait(batch(0)) and inbox.put_nowait(batch(1))
        assert not inbox.put_nowait(batch(2))  # full
        waiting = asyncio.ensure_future(inbox.put(batch(2)))
        await asyncio.sleep(0)
        assert not waiting.done()
        assert inbox.put_nowait(batch(0, loader=1))  # another loader's queue is its own
        assert (await inbox.get(0)).seq == 0  # room, but batch 2 waits for it: 3 may not overtake it
        assert not inbox.put_nowait(batch(3))
        await waiting
        assert not inbox.put_nowait(batch(3))  # full again
        assert [(await inbox.get(0)).seq for _ in range(2)] == [1, 2]
        assert inbox.put_nowait(batch(3)) and (await inbox.get(0)).seq == 3
    asyncio.run(scenario())
