"""A data loader's delivery to one NN rank (services/dataloader/delivery.py) over a real gRPC channel, and the NN
worker's side of it: a rank refuses a training batch that comes before the ones its share is missing, and the
loader answers by sending its unconfirmed frames again, oldest first."""
from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import grpc
import pytest

from hybridrec.core.runtime import rpc
from hybridrec.app.run.ports import free_port
from hybridrec.core.wire.frames import Consumed
from services.dataloader.delivery import DeliveryGap, Window, deliver
from services.nn_worker.ledger import Ledger

PUT = "/test.Rank/PutBatch"


def _frame(seq: int) -> bytes:
    return struct.pack("<q", seq)


class Rank:
    """A rank that takes its share in order: a frame past the next it expects is refused as out of order."""

    def __init__(self, expect: int, step: int = 2, incarnation: int = 7):
        self.expect, self.step, self.received, self.refused = expect, step, [], []
        self.incarnation = incarnation

    async def put(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        (seq,) = struct.unpack("<q", request)
        if seq > self.expect:
            self.refused.append(seq)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"batch {seq} before {self.expect}")
        if seq == self.expect:
            self.expect += self.step
        self.received.append(seq)
        return Consumed(incarnation=self.incarnation).encode()


async def _deliver_to(rank: Rank, window: Window) -> None:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("test.Rank", {"PutBatch": grpc.unary_unary_rpc_method_handler(
        rank.put)})
    server.add_generic_rpc_handlers((handler,))
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            put = channel.unary_unary(PUT)
            await deliver(window, lambda frame: put(frame, timeout=10), retry_s=10)
    finally:
        await server.stop(None)


def _window(seqs: list[int], delivered: int, incarnation: int = 7) -> Window:
    window = Window(incarnation=incarnation)
    for seq in seqs:
        window.add("train", seq, _frame(seq))
    window.delivered = delivered
    return window


def test_a_replacement_that_missed_its_predecessors_frames_gets_them_again_oldest_first():
    # Frames 12 and 14 went to a rank that died before training them; no call failed (a quiet stream), so the
    # loader still counts them delivered. Its replacement expects 12; the next new frame is 16.
    rank = Rank(expect=12, incarnation=8)
    window = _window([12, 14, 16], delivered=2)
    asyncio.run(_deliver_to(rank, window))
    assert rank.refused == [16] and rank.received == [12, 14, 16]
    assert window.delivered == 3 and window.resent == 2 and window.incarnation == 8


def test_a_replacement_that_answers_is_sent_what_went_to_its_predecessor():
    # The group trained 12 and 14, but their embedding updates may have died with the predecessor (unconfirmed):
    # the replacement takes 16 (the next of its share), and its reply names another process.
    rank = Rank(expect=16, incarnation=8)
    window = _window([12, 14, 16], delivered=2)
    asyncio.run(_deliver_to(rank, window))
    assert rank.received == [16, 12, 14, 16]  # 12 and 14 to settle; 16 again, dropped there as a copy
    assert window.delivered == 3 and window.resent == 2 and window.incarnation == 8
    same = _window([12, 14, 16], delivered=2)  # the same process: nothing again
    asyncio.run(_deliver_to(Rank(expect=16), same))
    assert same.resent == 0 and same.delivered == 3


def test_a_rank_that_refuses_the_oldest_unconfirmed_frame_is_a_real_gap():
    rank = Rank(expect=8)  # the group went back further than anything this loader still holds
    with pytest.raises(DeliveryGap, match="batch 12 before 8"):
        asyncio.run(_deliver_to(rank, _window([12, 14], delivered=0)))
    assert rank.received == []


def _ledger(next_seq: int, world_size: int = 2, opened: bool = True) -> Ledger:
    """Rank 0's ledger of one loader's stream, the group's state putting its next training batch at `next_seq`."""
    ledger = Ledger(0, world_size, 1)
    ledger.resume_at([next_seq // world_size])
    if opened:
        ledger.open()
    return ledger


def test_an_nn_worker_refuses_a_training_batch_past_the_next_of_its_share():
    ledger = _ledger(next_seq=12)
    batch = lambda seq: SimpleNamespace(loader=0, seq=seq)  # noqa: E731
    ledger.check_in_order(batch(12))  # the next one
    ledger.check_in_order(batch(10))  # one trained already: re-sent, dropped later as a duplicate
    with pytest.raises(rpc.FailedPrecondition, match="got training batch 14 .* holds none from batch 12"):
        ledger.check_in_order(batch(14))
    ledger.loaders[0].received["train"] = 12  # 12 is in its inbox: 14 is next
    ledger.check_in_order(batch(14))
    with pytest.raises(rpc.FailedPrecondition):
        ledger.check_in_order(batch(16))
    with pytest.raises(rpc.Unavailable):  # still joining its group: it cannot tell, the loader waits
        _ledger(next_seq=0, opened=False).check_in_order(batch(0))
