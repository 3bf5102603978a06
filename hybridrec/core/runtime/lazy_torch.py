"""torch, imported when first used, or on a thread while a service starts.

Importing torch costs seconds of CPU. Every service imports the frame code, which
uses torch for the fp16 value codec (hybridrec/core/wire/compress.py), but the data loader
never needs torch; the PS and the embedding worker start its import on a thread
at start-up (`import_torch_in_background`) so that it overlaps the rest, and say
they serve only once it is done (`imported`): on a host with a CUDA build of torch
the import took 2.4 s of CPU, which otherwise fell into the first seconds of
training, holding the GIL from the service's lookups.

Importing this module also silences one torch warning process-wide: frames decode
into read-only numpy views, and torch warns when it wraps one, but the codec only
reads them (every result is a new tensor).
"""
from __future__ import annotations

import asyncio
import threading
import warnings

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def import_torch(threads: int | None = None):
    """torch, imported on first use (`threads`: the torch thread count the caller wants)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch


def import_torch_in_background(threads: int) -> threading.Thread:
    """Start importing torch on a daemon thread, so that it overlaps the rest of a service's start-up."""
    thread = threading.Thread(target=import_torch, args=(threads,), name="import-torch", daemon=True)
    thread.start()
    return thread


async def imported(thread: threading.Thread | None) -> None:
    """Wait, without blocking the event loop, until a background import (`import_torch_in_background`) is done."""
    if thread is not None and thread.is_alive():
        await asyncio.to_thread(thread.join)
