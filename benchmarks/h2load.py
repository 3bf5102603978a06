"""gRPC unary calls from `h2load` (Debian's nghttp2-client), a load generator written in C.

A Python client costs more CPU per call than the inference service answers it
with, so on a small machine it hides the server's own latency: h2load sends
a prepared request body (the gRPC frame of one serialized message) over one
HTTP/2 connection, sequentially (`in_flight=1`) or with several streams in
flight, and logs every request's latency (`--log-file`), from which the
percentiles are computed here.
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np


def grpc_frame(message: bytes) -> bytes:
    """One length-prefixed gRPC message: flag 0 (uncompressed), big-endian length, the bytes."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def available() -> bool:
    return shutil.which("h2load") is not None


def unary(address: str, method: str, message: bytes, *, requests: int, in_flight: int = 1,
          warmup: int = 200) -> dict:
    """`requests` calls of `method` ("/package.Service/Method") with `message` on one connection, `in_flight`
    streams at a time, after `warmup` calls that are not counted: latency percentiles (ms), requests/s, and the
    HTTP statuses and gRPC failures seen (h2load counts a request as succeeded on HTTP 200 even when the
    trailers carry a gRPC error, so the answers are checked by the caller where it matters)."""
    if not available():
        raise RuntimeError("h2load is not installed (Debian: apt-get install nghttp2-client)")
    with tempfile.TemporaryDirectory(prefix="h2load-") as tmp:
        body = Path(tmp) / "body"
        body.write_bytes(grpc_frame(message))
        log = Path(tmp) / "log.tsv"
        base = ["h2load", "-c", "1", "-t", "1", "-m", str(in_flight), "-d", str(body),
                "-H", "content-type: application/grpc", "-H", "te: trailers", f"http://{address}{method}"]
        if warmup:
            subprocess.run(base[:1] + ["-n", str(warmup)] + base[1:], check=True, capture_output=True, timeout=300)
        out = subprocess.run(base[:1] + ["-n", str(requests), "--log-file", str(log)] + base[1:], check=True,
                             capture_output=True, text=True, timeout=600)
        rows = np.loadtxt(log, dtype=np.int64, ndmin=2)  # start (us since epoch), HTTP status, duration (us)
    if rows.shape[0] != requests:
        raise RuntimeError(f"h2load logged {rows.shape[0]} of {requests} requests:\n{out.stdout}")
    start, status, duration = rows[:, 0], rows[:, 1], rows[:, 2] / 1e3
    wall_s = (int((start + rows[:, 2]).max()) - int(start.min())) / 1e6
    return {"requests": requests, "in_flight": in_flight, "mean_ms": float(duration.mean()),
            "p50_ms": float(np.percentile(duration, 50)), "p99_ms": float(np.percentile(duration, 99)),
            "max_ms": float(duration.max()), "requests_per_s": requests / wall_s,
            "http_not_200": int((status != 200).sum())}
