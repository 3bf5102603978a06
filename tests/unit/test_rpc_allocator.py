"""rpc.tune_allocator: megabyte frame buffers come from the malloc heap, not from a fresh mmap each."""
from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrec.core.runtime import rpc

REPO = Path(__file__).resolve().parents[2]


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h)."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _check() -> None:
    """In a fresh interpreter (the allocator's state is process-wide: earlier tests may have tuned it or
    changed glibc's dynamic threshold)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    assert rpc.tune_allocator()
    mapped_before = libc.mallinfo2().hblkhd
    frames = [bytes(4 << 20) for _ in range(3)]  # what grpcio builds per received 4 MB message
    assert libc.mallinfo2().hblkhd == mapped_before
    assert all(len(f) == 4 << 20 for f in frames)
    big = bytes(64 << 20)  # above the threshold: still its own mapping, handed back when freed
    assert libc.mallinfo2().hblkhd >= mapped_before + len(big)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_4mb_frame_buffer_is_not_mmapped_once_tuned():
    result = subprocess.run([sys.executable, "-c", "from tests.unit.test_rpc_allocator import _check; _check()"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
