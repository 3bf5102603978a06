"""A rank replaced after this loader finished sending it a phase, while another rank's frames still wait for
room (services/dataloader/server.py, `Dispatcher._all_delivered`), over real gRPC channels.

The group waits in a collective for the replacement, so the busy rank takes nothing and the phase would not
end: the replacement must be sent its predecessor's unconfirmed frames while the phase is still open (a kill
test deadlocked so, loader 1 of three blocked on rank 0 for minutes, until its call was cut off)."""
from __future__ import annotations

import asyncio

import grpc

from hybridrec.app.run.ports import free_port
from hybridrec.core.config import from_dict
from hybridrec.core.wire.frames import Consumed, EndOfPhase, Received, decode_nn_batch
from services.dataloader.delivery import END, Window
from services.dataloader.server import DataLoaderServicer, Dispatcher


class Rank:
    """An NN worker's PutBatch and Received: `busy` holds every PutBatch until it is released."""

    def __init__(self, incarnation: int, busy: bool = False):
        self.incarnation, self.released = incarnation, asyncio.Event()
        if not busy:
            self.released.set()
        self.received: list[tuple[str, int]] = []

    async def put(self, request: bytes, context) -> bytes:
        await self.released.wait()
        item = decode_nn_batch(request, 1, 1, 1)
        self.received.append((item.phase, getattr(item, "seq", END)))
        return Consumed(incarnation=self.incarnation).encode()

    async def held(self, request: bytes, context) -> bytes:
        return Received({"train": -1, "eval": -1}, frozenset(), [], 0, self.incarnation).encode()


async def _serve(rank: Rank) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("hybridrec.NNWorker", {
        "PutBatch": grpc.unary_unary_rpc_method_handler(rank.put),
        "Received": grpc.unary_unary_rpc_method_handler(rank.held)}),))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


def test_a_rank_replaced_after_its_share_of_a_phase_is_sent_its_window_while_another_rank_is_busy():
    async def scenario():
        busy, rank1 = Rank(1, busy=True), Rank(7)
        servers = [await _serve(busy), await _serve(rank1)]
        config = from_dict({"data": {"train": ["x"]}, "num_dense": 1,
                            "cluster": {"nn_workers": [a for _, a in servers], "embedding_workers": ["127.0.0.1:1"],
                                        "retry_s": 10.0}})
        dispatcher = Dispatcher(config, DataLoaderServicer(0))
        # Rank 1's predecessor (incarnation 7) received training batches 23 and 25 and its end, and died
        # before training them: the loader still holds them, unconfirmed.
        window = Window(incarnation=7)
        for seq in (23, 25):
            window.add("train", seq, _dense(seq))
        window.add("train", END, EndOfPhase("train", {}, end_seq=27, rows_sent=13).encode())
        window.delivered = 3
        dispatcher.windows[1] = window
        phase = asyncio.ensure_future(dispatcher.run_phase("eval", iter(()), dict))
        while rank1.received != [("eval", END)]:  # its share of the phase: its end, taken by the predecessor
            await asyncio.sleep(0.01)
        rank1.incarnation, rank1.received = 8, []  # which then dies: its replacement holds nothing
        for _ in range(200):  # rank 1 is probed (IDLE_PROBE_S) while rank 0 still holds the phase open
            if len(rank1.received) == 4:
                break
            await asyncio.sleep(0.05)
        assert not phase.done()
        assert rank1.received == [("train", 23), ("train", 25), ("train", END), ("eval", END)], rank1.received
        busy.released.set()
        assert await asyncio.wait_for(phase, 10) == 0
        assert busy.received == [("eval", END)]
        await dispatcher.close()
        for server, _ in servers:
            await server.stop(None)

    asyncio.run(scenario())


def _dense(seq: int) -> bytes:
    import numpy as np

    from hybridrec.core.wire.frames import DenseBatch

    return DenseBatch(seq, np.zeros((1, 1), np.float32), np.zeros(1, np.float32), seq=seq).encode()
