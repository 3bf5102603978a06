"""Free loopback ports for the services of a local run, the local broker and the tests: one owner, below the
launcher and the broker, which both hand them out."""
from __future__ import annotations

import random
import socket
from pathlib import Path


LISTEN_PORTS = (10000, 65536)
"""Where `free_port` looks: outside this machine's ephemeral range (Linux's default is 32768-60999, so
10000-32767 and 61000-65535), so that no outgoing connection (a gRPC channel, a store client retrying while its
peer restarts) can be given a port a service is about to listen on, which a port chosen by bind(0) cannot
promise: a GPU machine whose ephemeral range started lower lost a run's rendezvous port that way."""

_handed_out: set[int] = set()  # a port is handed out once per process: the services bind theirs later


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nobody listens on now and no earlier call handed out, outside the ephemeral range when
    this machine leaves room for one."""
    low, high = LISTEN_PORTS
    eph_low, eph_high = _ephemeral_range()
    candidates = [*range(low, min(high, eph_low)), *range(max(low, eph_high + 1), high)]
    for port in random.sample(candidates, min(200, len(candidates))):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
