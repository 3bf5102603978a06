"""One training run across testbed hosts: build the network, start every service in its host, train,
evaluate, measure, tear down.

Every service is `hybridrec serve SERVICE --config <host's config> --replica N`
run with `ip netns exec <host namespace>`; the config each host gets is the
job's config with every replica's address (its host's address, a fixed port)
and `cluster.bind_host` = that host's address. NN worker rank 0 writes
summary.json to the run directory and the NN workers exit 0 when done.
Teardown (processes, namespaces with their links, the shm directory) runs on
success, on any failure, on SIGTERM and on Ctrl-C.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil

from benchmarks.testbed.net import Network, NetError, bridge_ns, host_ns, leftovers
from benchmarks.testbed.spec import SpecError, TestbedSpec, format_rate
from hybridrec.core.config import Config, dump_config, from_dict
from hybridrec.app.run.launcher import LaunchError, LocalCluster, ServiceProcess
from hybridrec.app.plan.layout import Host, fit
from hybridrec.core.runtime.service import SERVICE_KINDS
from hybridrec.core.layouts.summary import SERVICES_FILE, SUMMARY_FILE, RunSummary

BASE_PORT = 7100  # gRPC port of the i-th replica overall: BASE_PORT + i; metrics: METRICS_PORT + i
METRICS_PORT = 9300
RENDEZVOUS_PORT = 7099


class TestbedError(RuntimeError):
    """A service failed or the run did not finish; the message names it."""

    __test__ = False


@dataclass
class Fault:
    """A network fault, `at_s` seconds after NN worker rank 0's first training step (its `at_work`): on a
    loaded machine the first step can come seconds after the rank reports serving."""

    at_s: float
    host: str
    kind: str  # "down": link down for duration_s; "slow": rate / factor for duration_s; "lost": the host lost
    # whole (every process on it killed, its /dev/shm emptied) and brought back, empty, after duration_s
    duration_s: float
    factor: float = 10.0


def resolve(config: Config, spec: TestbedSpec, prefix: str,
            run_dir: Path) -> tuple[dict[str, Config], list[ServiceProcess]]:
    """Each host's config (every replica's host:port; bind_host = that host's address, written to
    run_dir/config-HOST.yaml when the services start) and the processes, each run in its host's namespace."""
    if config.cluster.sized_by_host():  # `auto` replica lists: as `hybridrec run` sizes them on this machine
        config, _ = fit(config, Host.here())
    replicas = {k.name: len(getattr(config.cluster, k.cluster_key)) for k in SERVICE_KINDS}
    where = spec.assign(replicas)
    tree = config.model_dump(mode="json")
    cluster = tree["cluster"]
    procs: list[ServiceProcess] = []
    index = 0
    for kind in SERVICE_KINDS:
        addresses = []
        for r in range(replicas[kind.name]):
            host = where[(kind.name, r)]
            address = f"{spec.address(host)}:{BASE_PORT + index}"
            addresses.append(address)
            procs.append(ServiceProcess(
                kind.name, r, address, f"{spec.address(host)}:{METRICS_PORT + index}",
                run_dir / "logs" / f"{kind.name}-{r}.log", run_dir / f"config-{host}.yaml",
                prefix=("ip", "netns", "exec", host_ns(prefix, host)),
                cpus=next(h for h in spec.hosts if h.name == host).cpu_set(), host=host,
                namespace=host_ns(prefix, host)))
            index += 1
        cluster[kind.cluster_key] = addresses
    cluster["rendezvous"] = f"{spec.address(where[('nn_worker', 0)])}:{RENDEZVOUS_PORT}"
    shm_root = f"/dev/shm/{prefix}-shm-{os.getpid()}"  # each host has its own below it, as machines do
    tree["output"]["dir"] = str(run_dir)
    if config.checkpoint.interval_steps and not config.checkpoint.dir:
        tree["checkpoint"]["dir"] = str(run_dir / "checkpoints")
    configs = {}
    for host in spec.hosts:
        cluster["bind_host"] = spec.address(host.name)
        tree["ps"]["shm_dir"] = f"{shm_root}/{host.name}"
        configs[host.name] = from_dict(tree, source=f"testbed config of host {host.name}")
    return configs, procs


class Testbed:
    """`with Testbed(config, spec, run_dir) as bed: summary = bed.run()`; teardown on exit, whatever happens."""

    __test__ = False

    def __init__(self, config: Config, spec: TestbedSpec, run_dir: Path, *, prefix: str = "hrtb",
                 faults: list[Fault] | None = None, timeout_s: float = 1800.0,
                 on_tick: Callable[["Testbed"], None] | None = None):
        self.spec, self.prefix, self.run_dir = spec, prefix, Path(run_dir)
        self.faults = faults or []
        self.timeout_s = timeout_s
        self.on_tick = on_tick
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.configs, procs = resolve(config, spec, prefix, self.run_dir)  # SpecError before anything exists
        # The launcher's runner, restarts off: a service that dies fails the run (what a testbed run measures).
        self.cluster = LocalCluster(next(iter(self.configs.values())), self.run_dir, procs, restarts=False)
        self.procs = procs
        self.cpu_s: dict[str, float] = {}  # per process: last sampled user+system CPU seconds (own + reaped children)
        self.net = Network(spec, prefix)
        self.shm_dir = Path(next(iter(self.configs.values())).ps.shm_dir).parent  # every host's is below it
        self.marks: dict[str, dict[str, Any]] = {}
        self._old_handlers: dict[int, Any] = {}

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        self._install_handlers()
        try:
            self.net.create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, frame):  # SIGTERM: like Ctrl-C, so the finally blocks tear everything down
            raise KeyboardInterrupt(f"signal {signum}")
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, stop)

    def teardown(self) -> None:
        """Stop every service, delete the namespaces (their links go with them), remove the shm directory."""
        try:
            self.stop_services()
        finally:
            self.net.destroy()
            import shutil
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()

    # -- services ------------------------------------------------------------------------------
    def start_services(self) -> None:
        for host, config in self.configs.items():
            dump_config(config, self.run_dir / f"config-{host}.yaml")
        for stale in (SUMMARY_FILE, "testbed.json", SERVICES_FILE):  # a reused run dir: nothing of a past run
            (self.run_dir / stale).unlink(missing_ok=True)
        for proc in self.procs:
            proc.log_path.unlink(missing_ok=True)  # fresh: the run's marks are read from these logs
        self.cluster.start()

    def check(self) -> bool:
        """True once every NN worker exited 0; TestbedError naming the service and its host on any other exit."""
        try:
            return self.cluster.check()
        except LaunchError as exc:
            raise TestbedError(str(exc)) from None

    def stop_services(self) -> None:
        self.cluster.stop()

    def sample_cpu(self) -> None:
        for proc in self.procs:
            if proc.popen is None or proc.popen.poll() is not None:
                continue
            try:
                t = psutil.Process(proc.popen.pid).cpu_times()
                self.cpu_s[proc.name] = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass

    def host_cpu(self) -> dict[str, float]:
        out = {h.name: 0.0 for h in self.spec.hosts}
        for proc in self.procs:
            out[proc.host] += self.cpu_s.get(proc.name, 0.0)
        return out

    def mark(self, name: str) -> None:
        """Snapshot link counters and per-host CPU under `name`."""
        self.sample_cpu()
        self.marks[name] = {"t": time.monotonic(), "links": self.net.counters(), "cpu_s": self.host_cpu()}

    def _rank0_event(self, event: str) -> bool:
        path = next(p.log_path for p in self.procs if p.service == "nn_worker" and p.replica == 0)
        try:
            return f'"event": "{event}"' in path.read_text(errors="replace")
        except OSError:
            return False

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train and evaluate; returns the summary and the measurements (also written to testbed.json)."""
        started = time.monotonic()
        self.mark("start")
        self.start_services()
        ready_at: float | None = None
        pending = sorted(self.faults, key=lambda f: f.at_s)
        active: list[tuple[float, Fault, dict]] = []
        fault_log: list[dict] = []
        next_sample = 0.0
        while not self.check():
            time.sleep(0.1)
            now = time.monotonic()
            if now - started > self.timeout_s:
                raise TestbedError(f"the run did not finish within {self.timeout_s:.0f} s")
            if now >= next_sample:
                next_sample = now + 0.5
                self.sample_cpu()
                if "ready" not in self.marks and self._rank0_event("process_group_ready"):
                    self.mark("ready")
                if ready_at is None and self._rank0_event("at_work"):  # its first training step
                    ready_at = now
                if "train_done" not in self.marks and self._rank0_event("train_done"):
                    self.mark("train_done")
                if self.on_tick:
                    self.on_tick(self)
            if ready_at is not None:
                while pending and now - ready_at >= pending[0].at_s:
                    fault = pending.pop(0)
                    self._apply(fault, True)
                    entry = {"host": fault.host, "kind": fault.kind, "start_s": round(now - ready_at, 2),
                             "started_in_training": "train_done" not in self.marks}
                    fault_log.append(entry)
                    active.append((now + fault.duration_s, fault, entry))
                for item in list(active):
                    if now >= item[0]:
                        self._apply(item[1], False)
                        item[2]["end_s"] = round(now - ready_at, 2)
                        item[2]["ended_in_training"] = "train_done" not in self.marks
                        active.remove(item)
        for _, fault, entry in active:
            self._apply(fault, False)
            entry["end_s"] = "after the run"
        if pending:
            raise TestbedError(f"the run ended before {len(pending)} fault(s) were injected (training too short?)")
        self.mark("end")
        if "train_done" not in self.marks:
            self.marks["train_done"] = self.marks["end"]
        summary = RunSummary.of_run(self.run_dir)
        result = self.measurements(summary, wall_s=time.monotonic() - started)
        result["faults"] = fault_log
        (self.run_dir / "testbed.json").write_text(json.dumps(result, indent=1))
        return result

    def _apply(self, fault: Fault, start: bool) -> None:
        host = next(h for h in self.spec.hosts if h.name == fault.host)
        if fault.kind == "lost":  # the machine is gone: its processes and its memory; back empty
            procs = [p for p in self.procs if p.host == fault.host]
            if start:
                self.cluster.take_down(procs)
                import shutil
                shutil.rmtree(self.configs[fault.host].ps.shm_dir, ignore_errors=True)
            else:
                self.cluster.bring_back(procs)
        elif fault.kind == "down":
            self.net.set_link(fault.host, up=not start)
        elif fault.kind == "slow":
            if host.link.up is None or host.link.down is None:
                raise TestbedError(f"a 'slow' fault needs host {fault.host}'s link shaped both ways")
            scale = 1.0 / fault.factor if start else 1.0
            self.net.shape(fault.host, host.link.up * scale, host.link.down * scale)
        else:
            raise TestbedError(f"unknown fault kind {fault.kind!r} (down, slow, lost)")

    def measurements(self, summary: RunSummary, wall_s: float) -> dict[str, Any]:
        def delta(a: str, b: str) -> dict:
            links = {h: {k: self.marks[b]["links"][h][k] - self.marks[a]["links"][h][k]
                         for k in self.marks[a]["links"][h]} for h in self.marks[a]["links"]}
            cpu = {h: round(self.marks[b]["cpu_s"][h] - self.marks[a]["cpu_s"].get(h, 0.0), 3)
                   for h in self.marks[b]["cpu_s"]}
            return {"seconds": round(self.marks[b]["t"] - self.marks[a]["t"], 3), "links": links, "cpu_s": cpu}
        train = delta("ready" if "ready" in self.marks else "start", "train_done")
        steps = max(summary.steps, 1)
        crossing = {h: v["tx_bytes"] + v["rx_bytes"] for h, v in train["links"].items()}
        return {
            "summary": summary.model_dump(mode="json"),
            "wall_s": round(wall_s, 2),
            "spec": self.spec.model_dump(mode="json"),
            "rates": {h.name: {"up": format_rate(h.link.up), "down": format_rate(h.link.down)} for h in self.spec.hosts},
            "addresses": {p.name: p.address for p in self.procs},
            "train": train,
            "total": delta("start", "end"),
            "bytes_per_step": {h: round(b / steps) for h, b in crossing.items()},
            "cpu_per_host_s": self.marks["end"]["cpu_s"],
        }


def run_testbed(config: Config, spec: TestbedSpec, run_dir: Path, **kwargs) -> dict[str, Any]:
    with Testbed(config, spec, run_dir, **kwargs) as bed:
        return bed.run()


__all__ = ["Fault", "NetError", "SpecError", "Testbed", "TestbedError", "bridge_ns", "leftovers", "run_testbed"]
