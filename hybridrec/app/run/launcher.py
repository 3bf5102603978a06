"""`hybridrec run`: the whole cluster as local processes on loopback (the embedded default).

The launcher resolves the config (free ports, a private shm directory, the run
directory), starts every replica with `hybridrec serve`, watches them, and tears
everything down on success, on Ctrl-C and on the first failed service — which it
names, with the last lines of its log. Children get PR_SET_PDEATHSIG, so even a
launcher killed with SIGKILL leaves no service behind.
"""
from __future__ import annotations

import enum
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from hybridrec.core.runtime import log, rpc
from hybridrec.core.config import Config, ConfigError, dump_config, from_dict
from hybridrec.core.wire.proto import pb
from hybridrec.core.model.evaluation import find_oracle
from hybridrec.app.run.ports import free_port
from hybridrec.app.run.forkserver import FORK_ENV, Forked, ForkServerError, ForkServers, die_with_parent, needs_dense
from hybridrec.app.plan.job_plan import JobPlan
from hybridrec.app.plan.layout import Layout
from hybridrec.app.report.write import write_report
from hybridrec.app.report.plots import preload_plots
from hybridrec.app.report.series import Recorder
from hybridrec.core.runtime.service import EXIT_PEER_LOST, SERVICE_KINDS, SERVICES, ServiceKind
from hybridrec.core.layouts.summary import (SUMMARY_FILE, Phases, Recovery, RunSummary, ServiceInfo, StreamSummary,
                                            write_services)

# The role lists, derived from the one table in hybridrec/core/runtime/service.py (see ServiceKind).
START_ORDER = tuple(kind.name for kind in SERVICE_KINDS)
FINISHING = tuple(kind.name for kind in SERVICE_KINDS if kind.finishes)
GROUP = tuple(kind.name for kind in SERVICE_KINDS if kind.restart_as_group)
DEATH_SETTLE_S = 0.5  # see LocalCluster.check
RESUMES_FROM = {kind.name: kind.resumes_from for kind in SERVICE_KINDS if kind.resumes_from}
STOP_GRACE_S = 5.0
LOG_TAIL_LINES = 25


class Action(enum.Enum):
    """What the launcher does about a process that exited (other than a clean finish)."""

    REPLACE = "replace"  # restart it alone; it continues from the state others hold (resumes_from)
    RESTART = "restart"  # restart it alone, in place (its state is in shm, or it has none)
    GROUP = "group"  # restart the NN workers and the data loader from the newest checkpoint
    FAIL = "fail"  # stop the run, naming it


def is_lost(rc: int) -> bool:
    """Killed by a signal, or stopped because a peer it needs was lost: not the process's own failure."""
    return rc < 0 or rc == EXIT_PEER_LOST


def after_death(kind: ServiceKind, rc: int, *, serving: bool, budget_left: bool, state_held: bool,
                checkpoints: bool, group_budget_left: bool) -> Action:
    """The restart policy. A process killed from outside after it was serving (a machine, an operator, a
    chaos test) is always restarted; its own failures and deaths before it ever served look like a crash
    loop and are restarted only while `budget_left` (cluster.max_restarts). `state_held`: the processes it
    resumes from are alive; a group restart needs a checkpoint directory (and, unless excused, group restarts
    left)."""
    lost = is_lost(rc)
    excused = lost and serving
    if lost and kind.resumes_from and state_held and (excused or budget_left):
        return Action.REPLACE
    if kind.restart_in_place and (excused or budget_left):
        return Action.RESTART
    if lost and kind.restart_as_group and checkpoints and (excused or group_budget_left):
        return Action.GROUP
    return Action.FAIL


class LaunchError(RuntimeError):
    """A service failed; the message names it and shows its last log lines."""


@dataclass
class ServiceProcess:
    """One replica: where it listens, the config it is started with, and what the runner knows of it."""

    service: str
    replica: int
    address: str
    metrics_address: str | None
    log_path: Path
    config_path: Path
    prefix: tuple[str, ...] = ()  # runs the command inside something: the testbed's `ip netns exec NS`
    cpus: set[int] | None = None  # pinned to these CPUs (the testbed's hosts), inherited by exec
    host: str | None = None  # the testbed's host it runs on
    namespace: str | None = None  # and that host's network namespace
    popen: subprocess.Popen | Forked | None = None
    finished: bool = False
    restarts: int = 0
    log_offset: int = 0  # how far the launcher has read the log (warnings are echoed, tagged)
    joining: bool = False  # restarted to rejoin its peers and not yet seen training with them
    serving: bool = False  # this process (since its last start) has answered the health check with SERVING
    failures: int = 0  # deaths that count against cluster.max_restarts (see LocalCluster.check)
    down: bool = False  # taken down on purpose (the testbed's lost host) until it is brought back
    recovering: Recovery | None = None  # restarted, and not yet seen at work (its `at_work` log line)

    @property
    def name(self) -> str:
        return f"{self.service}-{self.replica}"

    def describe(self) -> ServiceInfo:
        return ServiceInfo(name=self.service, replica=self.replica, pid=self.popen.pid if self.popen else None,
                           grpc=self.address, metrics=self.metrics_address, restarts=self.restarts, host=self.host,
                           namespace=self.namespace)

    @property
    def where(self) -> str:
        """The process as a failure names it: `nn_worker-1`, on the testbed `nn_worker-1 on host trainer`."""
        return self.name if self.host is None else f"{self.name} on host {self.host}"


def resolve(config: Config, run_dir: Path) -> Config:
    """The config every local service gets: loopback addresses on free ports, private shm and output dirs."""
    tree = config.model_dump(mode="json")
    cluster = tree["cluster"]
    for kind in SERVICE_KINDS:
        cluster[kind.cluster_key] = [f"127.0.0.1:{free_port()}" for _ in getattr(config.cluster, kind.cluster_key)]
    cluster["rendezvous"] = f"127.0.0.1:{free_port()}"
    cluster["bind_host"] = "127.0.0.1"
    run_name = f"run-{os.getpid()}-{int(time.time())}"
    tree["ps"]["shm_dir"] = str(Path(config.ps.shm_dir) / run_name)
    if config.ps.tier is not None:  # the disk tier is the stores' too: private to the run, removed with them
        tree["ps"]["tier"]["dir"] = str(Path(config.ps.tier.dir) / run_name)
    tree["output"]["dir"] = str(run_dir)
    if not config.checkpoint.dir:  # always: the final checkpoint makes a finished run exportable
        tree["checkpoint"]["dir"] = str(run_dir / "checkpoints")
    if not config.checkpoint.job_id:  # a PS shard that loses its store restores it (embedding_ps/lives.py)
        tree["checkpoint"]["job_id"] = f"run-{uuid.uuid4().hex}"
    if config.publish.enabled and not config.publish.dir:
        tree["publish"]["dir"] = str(run_dir / "versions")
    return from_dict(tree, source="resolved config")


class LocalCluster:
    """The cluster runner: starts every replica with `hybridrec serve`, keeps services.json current, applies
    the restart policy when one exits, stops them all.

    `hybridrec run` runs every replica on loopback (`on_loopback`); the testbed (benchmarks/testbed) gives it
    processes that run in their host's network namespace, with `restarts` off (a death fails its run)."""

    def __init__(self, config: Config, run_dir: Path, procs: list[ServiceProcess], *, restarts: bool = True,
                 forkserver: ForkServers | None = None):
        self.config, self.run_dir, self.procs, self.restarts = config, Path(run_dir), procs, restarts
        self.forkserver = forkserver
        """Forks the services (hybridrec/app/run/forkserver.py); without one, or for a process run inside a
        `prefix` (the testbed's network namespaces), each is started by executing `hybridrec serve`."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        rpc.use_tls(config.cluster.tls)
        self.log = log.get()
        self.group_restarts = 0
        self.recoveries: list[Recovery] = []

    @classmethod
    def on_loopback(cls, config: Config, run_dir: Path, forkserver: ForkServers | None = None) -> "LocalCluster":
        """Every replica a local process on a free loopback port, all started with run_dir/config.yaml, forked
        from `forkserver` (started already, or here)."""
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        config = resolve(config, run_dir)
        config_path = run_dir / "config.yaml"
        dump_config(config, config_path)
        procs = [ServiceProcess(service, replica, address, f"127.0.0.1:{free_port()}",
                                run_dir / "logs" / f"{service}-{replica}.log", config_path)
                 for service in START_ORDER
                 for replica, address in enumerate(getattr(config.cluster, SERVICES[service].cluster_key))]
        forkserver = forkserver or ForkServers(run_dir / "logs")
        forkserver.configure(config_path)
        if not config.ps.keep_shm:
            for path in _store_dirs(config):
                forkserver.clean_up_on_death(path)
        return cls(config, run_dir, procs, forkserver=forkserver)

    def start(self) -> None:
        """Start every replica. Forked ones are asked for all at once and collected after, in an order that
        keeps the parents busy: the light parent forks the embedding workers and the data loader at once and
        the PS shards once their kernels are compiled, while the dense parent is still importing torch."""
        if self.forkserver is not None and not self.forkserver.light.alive:
            self.forkserver.start()
        forked = sorted((p for p in self.procs if self._forks(p)), key=_fork_order)
        for proc in forked:
            self._submit(proc)
        for proc in forked:
            proc.popen = self._collect(proc)
            proc.serving = False
        for proc in self.procs:
            if not self._forks(proc):
                self._spawn(proc)
        self._write_services()

    def _forks(self, proc: ServiceProcess) -> bool:
        """Forked from the fork server (not a testbed process, which runs inside its host's namespace)."""
        return self.forkserver is not None and not proc.prefix

    @staticmethod
    def _env() -> dict[str, str]:
        return {**os.environ, **FORK_ENV}

    @staticmethod
    def argv(proc: ServiceProcess) -> list[str]:
        metrics_port = proc.metrics_address.rsplit(":", 1)[1]
        return ["serve", proc.service, "--config", str(proc.config_path), "--replica", str(proc.replica), "--set",
                f"cluster.metrics_port={metrics_port}"]

    def _submit(self, proc: ServiceProcess) -> None:
        try:
            self.forkserver.submit(self.argv(proc), proc.log_path, env=self._env(), cpus=proc.cpus)
        except ForkServerError as exc:
            raise LaunchError(str(exc)) from None

    def _collect(self, proc: ServiceProcess) -> Forked:
        try:
            forked = self.forkserver.collect(self.argv(proc))
        except ForkServerError as exc:
            raise LaunchError(f"{exc}; last lines of its logs:\n" + "\n".join(
                tail(path) for path in self.forkserver.log_paths)) from None
        self.log.debug("forked", service=proc.name, pid=forked.pid)
        return forked

    def _write_services(self) -> None:
        """run_dir/services.json: every replica's pid, gRPC and metrics address, kept current across restarts."""
        write_services(self.run_dir, [p.describe() for p in self.procs])

    def _spawn(self, proc: ServiceProcess) -> None:
        proc.serving = False
        if self._forks(proc):
            self._submit(proc)
            proc.popen = self._collect(proc)
            return
        cmd = [*proc.prefix, sys.executable, "-m", "hybridrec", *self.argv(proc)]
        with open(proc.log_path, "ab") as out:  # appended: a restarted service keeps its earlier lines
            proc.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          env=self._env(), preexec_fn=functools.partial(die_with_parent, proc.cpus),
                                          close_fds=True)
        self.log.debug("started", service=proc.name, pid=proc.popen.pid)

    def check(self) -> bool:
        """True once every NN worker finished cleanly (training on a stream: and the data loader, whose last
        acknowledgement must reach the broker); LaunchError as soon as any service fails.

        On the death of a process whose restart depends on its peers (an NN worker, the data loader), waits
        DEATH_SETTLE_S once before deciding: processes lost together (a machine, or a kill of several) die a
        few milliseconds apart on a loaded machine, and a peer still dying must not count as holding the state
        a replacement would resume from (that replaced one NN worker, then restarted the group for the other).
        A PS or an embedding worker is restarted in place whatever its peers do: at once."""
        noticed = time.time()
        if any(self._settles(p) for p in self.procs):
            time.sleep(DEATH_SETTLE_S)
        for proc in self.procs:
            rc = proc.popen.poll() if proc.popen else None
            if rc is None or proc.finished or proc.down:
                continue
            if rc == 0 and proc.service in FINISHING:
                proc.finished = True
                continue
            if not self.restarts:
                raise LaunchError(self._death(proc, rc))
            counted = not (proc.serving and is_lost(rc))
            proc.failures += counted
            action = after_death(SERVICES[proc.service], rc, serving=proc.serving,
                                 budget_left=proc.failures <= self.config.cluster.max_restarts,
                                 state_held=proc.service in RESUMES_FROM and self._state_held_for(proc),
                                 checkpoints=bool(self.config.checkpoint.dir),
                                 group_budget_left=self.group_restarts < self.config.cluster.max_restarts)
            if action is not Action.FAIL:
                self._recovering(proc, rc, action, noticed)
            if action is Action.REPLACE:
                proc.joining = proc.service == RESUMES_FROM[proc.service]  # rejoins its peers
                self._restart_alone(proc, rc, "service_replaced")
                continue
            if action is Action.RESTART:
                self._restart_alone(proc, rc, "service_restarted")
                continue
            if action is Action.GROUP:
                self._restart_group(proc, rc, counted=counted, noticed=noticed)
                return False
            raise LaunchError(self._death(proc, rc))
        finished = all(p.finished for p in self.procs if p.service == "nn_worker")
        if finished and self.config.data.stream is not None:  # and the loader's last acknowledgement is in
            finished = all(p.finished for p in self.procs if p.service == "dataloader")
        return finished

    @staticmethod
    def _settles(proc: ServiceProcess) -> bool:
        """`proc` died (not a clean finish) and what becomes of it depends on which of its peers are alive."""
        rc = proc.popen.poll() if proc.popen and not proc.finished and not proc.down else None
        kind = SERVICES[proc.service]
        return rc is not None and not (rc == 0 and kind.finishes) and (kind.resumes_from or kind.restart_as_group)

    def _recovering(self, proc: ServiceProcess, rc: int, action: Action, down_at: float) -> None:
        """Start timing `proc`'s recovery: until its replacement logs `at_work` (see `_note_at_work`)."""
        proc.recovering = Recovery(service=proc.service, replica=proc.replica, exit_code=rc, action=action.value,
                                   down_at=down_at)
        self.recoveries.append(proc.recovering)

    @staticmethod
    def _note_at_work(proc: ServiceProcess, record: dict) -> None:
        """A replacement's first piece of work ends its recovery."""
        if proc.recovering is None or "timestamp" not in record:
            return
        at = log.timestamp_of(record)
        if at < proc.recovering.down_at:  # the lost process's own line, read late
            return
        proc.recovering.seconds, proc.recovering.what = round(at - proc.recovering.down_at, 3), record.get("what")
        proc.recovering = None

    @staticmethod
    def _death(proc: ServiceProcess, rc: int) -> str:
        return (f"service {proc.where} (pid {proc.popen.pid}) exited with code {rc}"
                f"{' (' + signal.Signals(-rc).name + ')' if rc < 0 else ''}; "
                f"last lines of {proc.log_path}:\n{tail(proc.log_path)}")

    def echo_warnings(self) -> None:
        """Show new warning/error lines of every service on the launcher's stderr, tagged with the service."""
        for proc in self.procs:
            try:
                with open(proc.log_path, "rb") as f:
                    f.seek(proc.log_offset)
                    chunk = f.read()
            except OSError:
                continue
            complete = chunk.rfind(b"\n") + 1
            proc.log_offset += complete
            for raw in chunk[:complete].splitlines():
                line = raw.decode(errors="replace")
                try:
                    record = json.loads(line)
                except ValueError:  # not structlog output: a crash trace or a library print
                    if "Traceback" in line or "Error" in line:
                        print(f"[{proc.name}] {line}", file=sys.stderr)
                    continue
                if isinstance(record, dict) and record.get("event") == "at_work":
                    self._note_at_work(proc, record)
                if isinstance(record, dict) and record.get("level") in ("warning", "error", "critical"):
                    event = record.pop("event", "")
                    extra = " ".join(f"{k}={v}" for k, v in record.items()
                                     if k not in ("level", "timestamp", "service", "replica"))
                    print(f"[{proc.name}] {record['level']}: {event} {extra}", file=sys.stderr)

    def _restart_alone(self, proc: ServiceProcess, rc: int, event: str) -> None:
        proc.restarts += 1
        self.log.warning(event, service=proc.name, exit_code=rc, restarts=proc.restarts, log=str(proc.log_path))
        self._spawn(proc)
        self._write_services()

    def end_stream(self) -> None:
        """Tell the data loader to end training with the events it has read (a run on `data.stream`)."""
        for proc in self.procs:
            if proc.service == "dataloader" and proc.popen and proc.popen.poll() is None:
                _signal(proc.popen, signal.SIGUSR1)

    def take_down(self, procs: list[ServiceProcess]) -> None:
        """SIGKILL `procs` together and keep them down, not counted as failures (a host lost on purpose)."""
        for proc in procs:
            proc.down = True
            if proc.popen and proc.popen.poll() is None:
                _signal(proc.popen, signal.SIGKILL)
        for proc in procs:
            if proc.popen:
                proc.popen.wait()
        self.log.warning("services_taken_down", services=[p.where for p in procs])

    def bring_back(self, procs: list[ServiceProcess]) -> None:
        """Start `procs` again after `take_down`, each counted as a restart."""
        for proc in procs:
            proc.down = False
            proc.restarts += 1
            self._spawn(proc)
        self._write_services()
        self.log.warning("services_brought_back", services=[p.where for p in procs])

    def _state_held_for(self, proc: ServiceProcess) -> bool:
        """The state `proc` continues from is alive: for an NN worker, a peer that is not itself a replacement
        still joining; for the data loader, every NN worker (each tells it how far its share has come)."""
        holders = [p for p in self.procs if p is not proc and p.service == RESUMES_FROM[proc.service]]
        alive = [p for p in holders if p.popen and p.popen.poll() is None]
        if proc.service == RESUMES_FROM[proc.service]:
            return any(not p.joining for p in alive)
        return bool(holders) and len(alive) == len(holders)

    def note_statuses(self, statuses: list[pb.TrainingStatus | None]) -> None:
        """A replacement that reports a training phase has rejoined its group."""
        ranks = sorted((p for p in self.procs if p.service == "nn_worker"), key=lambda p: p.replica)
        for proc, status in zip(ranks, statuses):
            if proc.joining and status is not None and status.phase not in ("", "starting"):
                proc.joining = False

    def _restart_group(self, failed: ServiceProcess, rc: int, *, counted: bool, noticed: float) -> None:
        """The dense part never loses a synchronisation: every NN worker and the data loader go back to
        the newest checkpoint together (Persia paper (Lian et al., KDD 2022) §4.2.4). `counted`: against
        cluster.max_restarts (not when `failed` was killed from outside while serving)."""
        self.group_restarts += counted
        self.log.warning("group_restart", failed=failed.name, exit_code=rc, restarts=self.group_restarts,
                         checkpoint_dir=self.config.checkpoint.dir)
        group = [p for p in self.procs if p.service in GROUP]
        for proc in group:
            if proc.popen and proc.popen.poll() is None:
                _signal(proc.popen, signal.SIGKILL)
                proc.popen.wait()
            if proc is not failed:
                self._recovering(proc, proc.popen.returncode if proc.popen else -signal.SIGKILL, Action.GROUP,
                                 noticed)
        for proc in group:
            proc.restarts += 1
            proc.finished = False
            proc.joining = False
            self._spawn(proc)
        self._write_services()

    def note_serving(self) -> None:
        """Ask each live process not yet seen SERVING since its start (a few, and only until they serve)."""
        for proc in self.procs:
            if not proc.serving and proc.popen and proc.popen.poll() is None:
                proc.serving = rpc.is_serving_now(proc.address, timeout_s=0.3)

    def statuses(self) -> list[pb.TrainingStatus | None]:
        """Every NN worker's training status in rank order (asked in parallel); None for a rank that does not
        answer right now."""
        addresses = [p.address for p in sorted((p for p in self.procs if p.service == "nn_worker"),
                                              key=lambda p: p.replica)]
        channels = [rpc.sync_channel(address) for address in addresses]
        try:
            futures = []
            for channel in channels:
                call = channel.unary_unary("/hybridrec.NNWorker/Status",
                                           request_serializer=pb.Empty.SerializeToString,
                                           response_deserializer=pb.TrainingStatus.FromString)
                futures.append(call.future(pb.Empty(), timeout=1.0))
            out = []
            for future in futures:
                try:
                    out.append(future.result())
                except grpc.RpcError:
                    out.append(None)
            return out
        finally:
            for channel in channels:
                channel.close()

    def stop(self) -> None:
        """SIGTERM in reverse start order, SIGKILL whatever is left after a grace period."""
        alive = [p.popen for p in reversed(self.procs) if p.popen and p.popen.poll() is None]
        for popen in alive:
            _signal(popen, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for popen in alive:
            try:
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(popen, signal.SIGKILL)
                popen.wait()
        if not self.config.ps.keep_shm:
            for path in _store_dirs(self.config):
                shutil.rmtree(path, ignore_errors=True)
        if self.forkserver is not None:
            self.forkserver.close()


def _store_dirs(config: Config) -> list[str]:
    """The run's PS store directories, removed when it ends unless ps.keep_shm: shared memory and disk tier."""
    return [config.ps.shm_dir, *([config.ps.tier.dir] if config.ps.tier is not None else [])]


def _fork_order(proc: ServiceProcess) -> tuple[bool, bool]:
    """Light before dense (`LocalCluster.start`), and PS shards last of the light: the parent compiles their
    kernels first."""
    return needs_dense(LocalCluster.argv(proc)), proc.service == "embedding_ps"


def _signal(popen: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        popen.send_signal(sig)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "  (no log)"
    return "\n".join("  " + line for line in text[-lines:]) or "  (empty log)"


SAMPLE_EVERY_S = 1.0


def run_local(config: Config, run_dir: Path, *, progress=None, check_model: bool = False,
              forkserver: ForkServers | None = None, layout: Layout | None = None) -> RunSummary:
    """Run the whole job locally; returns the summary. Raises LaunchError on a failed service.

    The job's plan (`JobPlan`: every replica's address and part, the PS's stores and memory) is written to
    run_dir/plan.json once the ports are chosen, before any service starts; `layout`: how the config's replica
    counts were fitted to the host (`hybridrec run`), recorded in it.

    `forkserver`: the services' parents, started already (the CLI starts them before the rest of its set-up);
    by default started here.

    `check_model`: build the model once in a process of its own beside the start-up (`ModelCheck`): a bad
    model stops the services and raises ConfigError with its message.

    About once a second it polls every NN worker's Status and every service's CPU and memory for the
    run report; a run that fails part-way still gets a report of what was recorded, marked incomplete."""
    recorder = Recorder(ranks=len(config.cluster.nn_workers))  # t = 0: launch
    broker = None
    if config.data.stream is not None and config.data.stream.url is None:  # a broker of its own for the run
        from hybridrec.app.run.broker import LocalBroker, with_url

        broker = LocalBroker(run_dir)
        config = with_url(config, broker.start(config.data.stream, partitions=len(config.cluster.dataloader)))
    cluster = LocalCluster.on_loopback(config, run_dir, forkserver)
    JobPlan.of(cluster.config, layout).write(run_dir)
    check = None
    next_sample = time.monotonic()
    if config.data.stream is not None:  # the first Ctrl-C ends training with what was read, the second stops all
        def end_stream(signum, frame) -> None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            log.get().warning("stream_ending", why="Ctrl-C: training ends with the events read so far, then "
                                                   "evaluation and the final checkpoint; Ctrl-C again stops at once")
            cluster.end_stream()

        signal.signal(signal.SIGINT, end_stream)
    try:
        try:
            cluster.start()
            check = ModelCheck.start(cluster) if check_model else None
            while True:
                finished = cluster.check()
                if check is not None and check.passed():  # ConfigError once it failed
                    check = None
                if check is None and finished:
                    break
                time.sleep(0.1)
                if time.monotonic() >= next_sample:
                    next_sample = time.monotonic() + SAMPLE_EVERY_S
                    asked = recorder.now()
                    statuses = cluster.statuses()
                    cluster.note_statuses(statuses)
                    cluster.note_serving()
                    recorder.sample(statuses, [(p.name, p.popen.pid if p.popen else None) for p in cluster.procs],
                                    asked=asked)
                    if "first_step" in recorder.phases:
                        preload_plots()  # once training runs: the report's plotting library is imported by then
                    if check is None:  # until the model is known good, an NN worker's crash is its consequence,
                        cluster.echo_warnings()  # which the check's one message says
                    if progress is not None:
                        progress(statuses)
            recorder.mark("end_of_eval")
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            cluster.stop()
            if check is None:
                cluster.echo_warnings()  # the last lines: warnings, and the end of a recovery (at_work)
            if broker is not None:
                broker.stop()
            recorder.mark("end")
        summary_path = run_dir / SUMMARY_FILE
        try:
            summary = RunSummary.read(summary_path)
        except (OSError, ValueError) as exc:
            raise LaunchError(f"the NN workers finished but {summary_path} is missing or unreadable: {exc}") from None
    except LaunchError as exc:
        if check is not None and (failure := check.failure(wait_s=60)):  # an NN worker failed on the model first
            raise ConfigError(failure) from None
        report = _partial_report(run_dir, recorder, cluster, str(exc))
        raise LaunchError(f"{exc}\n{report}") from None
    except KeyboardInterrupt:
        _partial_report(run_dir, recorder, cluster, "interrupted (Ctrl-C): every service was stopped")
        raise
    recorder.settle(summary.model_dump())
    summary = summary.model_copy(update={
        "stream": StreamSummary.read(run_dir) if config.data.stream is not None else None,
        "wall_s": recorder.phases["end"], "oracle_auc": find_oracle(config), "run_dir": str(run_dir),
        "services": [p.describe() for p in cluster.procs], "recoveries": cluster.recoveries or None,
        "phases": Phases(**{k: recorder.phases.get(k) for k in Phases.model_fields})})
    summary.report = str(write_report(run_dir, summary, recorder))
    summary.write(summary_path)
    return summary


class ModelCheck:
    """`hybridrec check --only model`, forked beside the services' start-up from the parent that has imported
    torch already."""

    def __init__(self, proc: Forked, log_path: Path):
        self.proc, self.log_path = proc, log_path

    @classmethod
    def start(cls, cluster: LocalCluster) -> "ModelCheck":
        log_path = cluster.run_dir / "logs" / "model-check.log"
        argv = ["check", str(cluster.run_dir / "config.yaml"), "--only", "model"]  # LocalCluster.on_loopback's
        try:
            return cls(cluster.forkserver.spawn(argv, log_path), log_path)
        except ForkServerError as exc:
            raise LaunchError(str(exc)) from None

    def passed(self) -> bool:
        """True once the check passed, False while it runs; ConfigError once it failed (which stops every
        service)."""
        failure = self.failure()
        if failure is not None:
            raise ConfigError(failure)
        return self.proc.poll() is not None

    def failure(self, wait_s: float = 0.0) -> str | None:
        """The check's error message once it failed; None while it runs (up to `wait_s`) or when it passed."""
        try:
            rc = self.proc.wait(timeout=wait_s) if wait_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None
        if not rc:
            return None
        text = self.log_path.read_text(errors="replace")
        marker = "hybridrec: error: "
        return text[text.rindex(marker) + len(marker):].strip() if marker in text else \
            f"the model check exited with code {rc}:\n{tail(self.log_path)}"


def _partial_report(run_dir: Path, recorder: Recorder, cluster: LocalCluster, error: str) -> str:
    """The report of a failed run (what was recorded, marked incomplete); a line saying where it is."""
    partial = None
    try:
        partial = json.loads((run_dir / SUMMARY_FILE).read_text())
        recorder.settle(partial)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        page = write_report(run_dir, partial, recorder, error=error,
                            services=[p.describe() for p in cluster.procs])
    except Exception as exc:  # the failure itself is what the user needs to see
        return f"(no report: {type(exc).__name__}: {exc})"
    return f"partial report (incomplete run): {page}"


def rank_step(run_dir: Path, rank: int = 0) -> int | None:
    """The step NN worker `rank` of the run in `run_dir` (`hybridrec run --run-dir`) is at, from its Status
    RPC; None while the run has not written its config or the rank does not answer (starting, replaced)."""
    import yaml

    try:
        address = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())["cluster"]["nn_workers"][rank]
    except (OSError, TypeError, KeyError, IndexError):
        return None
    status = rpc.training_status(address)
    return None if status is None else status.step
