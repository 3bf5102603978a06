"""The NN worker's compute thread (services/nn_worker/compute.py): every call on one thread, in the order
handed over, through `run` (the trainer's steps) and `run_in_executor` alike; results and errors reach their
callers; a call cancelled before it starts does not run; shutdown cancels what has not started."""
from __future__ import annotations

import asyncio
import threading

import pytest

from services.nn_worker.compute import ComputeThread


def test_calls_run_on_one_thread_in_order_and_answer_their_callers():
    seen: list[tuple[str, int]] = []
    started = threading.Event()

    async def scenario():
        compute = ComputeThread(initializer=lambda: seen.append((threading.current_thread().name, -1)))
        loop = asyncio.get_running_loop()
        try:
            def record(i: int) -> int:
                seen.append((threading.current_thread().name, i))
                return i * i

            calls = [compute.run(record, i) if i % 2 else loop.run_in_executor(compute, record, i) for i in range(50)]
            assert await asyncio.gather(*calls) == [i * i for i in range(50)]
            assert seen == [("compute", i) for i in range(-1, 50)]

            def fail():
                raise ValueError("bad step")
            with pytest.raises(ValueError, match="bad step"):
                await compute.run(fail)

            # A call cancelled before it starts is skipped; the next one runs.
            gate = threading.Event()
            blocker = compute.run(lambda: (started.set(), gate.wait(10)))
            await asyncio.to_thread(started.wait, 10)
            skipped = compute.run(record, 100)
            skipped.cancel()
            after = compute.run(record, 101)
            gate.set()
            await blocker
            assert await after == 101 * 101
            assert ("compute", 100) not in seen
        finally:
            compute.shutdown()
    asyncio.run(scenario())


def test_shutdown_cancels_what_has_not_started():
    async def scenario():
        compute = ComputeThread()
        gate, started = threading.Event(), threading.Event()
        running = compute.run(lambda: (started.set(), gate.wait(10))[1])
        await asyncio.to_thread(started.wait, 10)
        waiting, submitted = compute.run(lambda: 1), compute.submit(lambda: 2)
        compute.shutdown(wait=False, cancel_futures=True)
        gate.set()
        assert await running is True
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert submitted.cancelled()
        with pytest.raises(RuntimeError, match="shut down"):
            compute.run(lambda: 3)
    asyncio.run(scenario())
