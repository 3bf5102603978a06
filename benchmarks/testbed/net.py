"""Network namespaces as hosts, veth links through a bridge namespace, tbf shaping, link counters.

Everything made here carries a name prefix (namespaces `<prefix>-br` and
`<prefix>-<host>`; interfaces live only inside them), so `cleanup(prefix)`
finds and removes leftovers of a run that was killed. Deleting a namespace
deletes its veth ends; processes are killed by the pids the kernel lists for
each namespace (`ip netns pids`), never by name.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.testbed.spec import TestbedSpec

HOST_IF = "eth0"


class NetError(RuntimeError):
    """Creating or changing the testbed's network failed; the message says which command and why."""


def ip(*args: str, check: bool = True) -> str:
    return _run(["ip", *args], check=check)


def _run(cmd: list[str], check: bool = True) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetError(f"`{cmd[0]}` not found: install iproute2") from None
    if check and done.returncode != 0:
        hint = ""
        err = done.stderr.strip()
        if os.geteuid() != 0 or "Operation not permitted" in err:
            hint = " (needs root: CAP_NET_ADMIN and CAP_SYS_ADMIN)"
        elif cmd[:2] == ["tc", "qdisc"] or (cmd[0] == "ip" and "tc" in cmd):
            hint = " (is the kernel's sch_tbf module available?)"
        elif "veth" in cmd:
            hint = " (is the kernel's veth module available?)"
        raise NetError(f"`{' '.join(cmd)}` failed: {err or 'exit code ' + str(done.returncode)}{hint}")
    return done.stdout


def bridge_ns(prefix: str) -> str:
    return f"{prefix}-br"


def host_ns(prefix: str, host: str) -> str:
    return f"{prefix}-{host}"


def port_name(host: str) -> str:
    return f"p-{host}"  # the bridge's port to `host`, inside the bridge namespace (<= 15 chars)


def tbf(ns: str, dev: str, rate: float | None) -> None:
    """Shape `dev`'s egress to `rate` bit/s (None: remove shaping)."""
    if rate is None:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
        return
    # Burst: at least a few 64 KB GSO segments (veth sends them whole), and 4 ms worth of the rate.
    burst = max(256 * 1024, int(rate / 8 * 0.004))
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
          "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "200ms"])


class Network:
    """The namespaces and links of one spec; `create()` builds them (cleaning up what it made if a step
    fails), `destroy()` removes them."""

    def __init__(self, spec: TestbedSpec, prefix: str):
        self.spec, self.prefix = spec, prefix
        self.created: list[str] = []

    def create(self) -> None:
        if os.geteuid() != 0:
            raise NetError("the testbed creates network namespaces and veth links: run it as root")
        existing = namespaces(self.prefix)
        if existing:
            raise NetError(f"namespaces with prefix {self.prefix!r} exist already ({', '.join(existing)}): "
                           f"another testbed is running, or run `python -m benchmarks.testbed cleanup "
                           f"--prefix {self.prefix}`")
        try:
            br = bridge_ns(self.prefix)
            self._add_ns(br)
            ip("-n", br, "link", "add", "br0", "type", "bridge")
            ip("-n", br, "link", "set", "br0", "up")
            for host in self.spec.hosts:
                ns = host_ns(self.prefix, host.name)
                self._add_ns(ns)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("link", "add", HOST_IF, "netns", ns, "type", "veth", "peer", "name", port_name(host.name),
                   "netns", br)
                ip("-n", ns, "addr", "add", f"{self.spec.address(host.name)}/24", "dev", HOST_IF)
                ip("-n", ns, "link", "set", HOST_IF, "up")
                ip("-n", br, "link", "set", port_name(host.name), "master", "br0")
                ip("-n", br, "link", "set", port_name(host.name), "up")
                self.shape(host.name, host.link.up, host.link.down)
        except BaseException:
            self.destroy()
            raise

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.created.append(ns)

    def shape(self, host: str, up: float | None, down: float | None) -> None:
        """Rates of `host`'s link: up = host -> bridge, down = bridge -> host (bit/s; None: unshaped)."""
        tbf(host_ns(self.prefix, host), HOST_IF, up)
        tbf(bridge_ns(self.prefix), port_name(host), down)

    def set_link(self, host: str, up: bool) -> None:
        """Take `host`'s link down (the bridge's port: the host's eth0 loses its carrier) or up again."""
        ip("-n", bridge_ns(self.prefix), "link", "set", port_name(host), "up" if up else "down")

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each host's link carried: tx = host -> bridge, rx = bridge -> host."""
        out = {}
        for host in self.spec.hosts:
            info = json.loads(ip("-n", host_ns(self.prefix, host.name), "-j", "-s", "link", "show", "dev", HOST_IF))
            stats = info[0]["stats64"]
            out[host.name] = {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                              "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"],
                              "tx_dropped": stats["tx"]["dropped"]}
        return out

    def destroy(self) -> None:
        for ns in reversed(self.created):
            remove_namespace(ns)
        self.created.clear()


def namespaces(prefix: str) -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def remove_namespace(ns: str) -> None:
    """Kill every process in `ns` (by the pids the kernel lists for it), then delete it."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        pids = _pids(ns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline and _pids(ns):
            time.sleep(0.05)
    _run(["ip", "netns", "del", ns], check=False)


def _pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def shm_dirs(prefix: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"{prefix}-*"))


def cleanup(prefix: str) -> list[str]:
    """Remove every namespace (and the processes and links in it) and shm directory with this prefix."""
    removed = []
    for ns in namespaces(prefix):
        remove_namespace(ns)
        removed.append(f"namespace {ns}")
    for path in shm_dirs(prefix):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def leftovers(prefix: str) -> list[str]:
    """What of a testbed with this prefix still exists (empty after a complete teardown)."""
    return [f"namespace {n}" for n in namespaces(prefix)] + [str(p) for p in shm_dirs(prefix)]
