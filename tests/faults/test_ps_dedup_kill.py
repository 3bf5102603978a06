"""kill -9 of a PS process: an update re-sent to the restarted shard is recognised and not applied again.

A real `hybridrec serve embedding_ps` applies an update, is killed with
SIGKILL, and is started again on the same shm directory (as `hybridrec run`
restarts it). The re-sent update (same update id) is answered with 0 rows,
the rows hold one step, not two, and the shard counts the duplicate.
"""
from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest

from hybridrec.core.runtime import rpc
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.wire.frames import Applied, PSLookup, PSRows, PSUpdate
from hybridrec.core.wire.proto import pb
from tests.faults.ps_process import ps_process

pytestmark = pytest.mark.faults

VALUES = ValueCodec()  # the config's default compression: fp16 values
IDS = np.arange(1, 201, dtype=np.uint64)


async def _call(address: str, method: str, frame: bytes) -> bytes:
    await rpc.wait_until_serving([address], timeout_s=120)
    async with rpc.channel(address) as channel:
        return await rpc.raw_method(channel, "EmbeddingPS", method)(frame, timeout=30)


async def _rows(address: str, *, train: bool = False) -> np.ndarray:
    reply = await _call(address, "Lookup", PSLookup({8: IDS}, train=train).encode())
    return PSRows.decode(reply, VALUES, {8: IDS.size}).rows[8]


async def _deduplicated(address: str) -> float:
    async with rpc.channel(address) as channel:
        stats = await rpc.control_method(channel, "EmbeddingPS", "Stats")(pb.Empty(), timeout=30)
    return stats.values["updates_deduplicated_total"]


def test_an_update_re_sent_to_a_restarted_ps_is_applied_once(tmp_path):
    update = PSUpdate({8: IDS}, {8: np.full((IDS.size, 8), 0.25, np.float32)}, update_id=0xC0FFEE).encode(VALUES)
    with ps_process(tmp_path) as (address, proc):
        asyncio.run(_rows(address, train=True))  # admit the rows
        before = asyncio.run(_rows(address))
        assert Applied.decode(asyncio.run(_call(address, "Update", update))).applied == IDS.size
        once = asyncio.run(_rows(address))
        assert not np.array_equal(once, before)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with ps_process(tmp_path) as (address, proc):  # the same shm directory: it re-attaches
        assert Applied.decode(asyncio.run(_call(address, "Update", update))).applied == 0
        np.testing.assert_array_equal(asyncio.run(_rows(address)), once)
        assert asyncio.run(_deduplicated(address)) == 1
        other = PSUpdate({8: IDS}, {8: np.full((IDS.size, 8), 0.25, np.float32)}, update_id=0xC0FFEF)
        assert Applied.decode(asyncio.run(_call(address, "Update", other.encode(VALUES)))).applied == IDS.size
