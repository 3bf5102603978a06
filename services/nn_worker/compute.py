"""The NN worker's compute thread: the one thread that makes every torch and torch.distributed call.

Collectives must be issued in the same order on every rank, and no tensor may be touched by two threads, so
the trainer hands every torch call to this one thread (`DenseGroup.on_compute`). It is handed one per training
step, and the hand-off is what the event loop pays for it: `run` puts the call on a queue (`SimpleQueue`, in
C) and the thread answers with `call_soon_threadsafe`, about 30 us of the event loop's CPU a call in a loop,
against 50-58 for `loop.run_in_executor` on a one-thread `ThreadPoolExecutor`, whose concurrent future, its
lock and the chaining of two futures cost the rest. It is also an `Executor`, so `run_in_executor` and
`submit` (the checkpointer, the publisher, the group's joining) run on the same thread, in order.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
from typing import Any, Callable


class ComputeThread(concurrent.futures.Executor):
    """One thread running the calls handed to it in order; `initializer` runs on it first."""

    def __init__(self, name: str = "compute", initializer: Callable[[], None] | None = None):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, args=(initializer,), name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """`fn(*args)` on the thread; a future of the running loop, resolved there with its result. A future
        cancelled before its call starts skips the call (as `run_in_executor`'s does)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._put((fn, args, (loop, future)))
        return future

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put((functools.partial(fn, **kwargs) if kwargs else fn, args, future))
        return future

    def _put(self, item: tuple) -> None:
        if self._closed:
            raise RuntimeError("cannot schedule new calls after the compute thread was shut down")
        self._queue.put(item)

    def _work(self, initializer: Callable[[], None] | None) -> None:
        if initializer is not None:
            initializer()
        while (item := self._queue.get()) is not None:
            fn, args, target = item
            if isinstance(target, concurrent.futures.Future):
                if target.set_running_or_notify_cancel():
                    try:
                        target.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                        target.set_exception(exc)
                continue
            loop, future = target
            if future.cancelled():  # a read of its state: the loop's thread is the only one to change it
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: nobody waits for the answer
                pass

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop once the calls queued so far ran (or, `cancel_futures`, once the running one ends: the others
        are cancelled)."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    _cancel(item[2])
        self._queue.put(None)
        if wait:
            self._thread.join()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _cancel(target: Any) -> None:
    if isinstance(target, concurrent.futures.Future):
        target.cancel()
        return
    loop, future = target
    try:
        loop.call_soon_threadsafe(future.cancel)
    except RuntimeError:  # the loop is closed
        pass
