"""On the NN worker: forming the dense process group, and re-forming it when a rank is replaced.

The group is re-initialised on a generation counter (not torch's elastic
rendezvous: that restarts every worker on a membership change and so throws
the replicated dense state away, while here the survivors hand theirs to the
replacement). Rank 0 hosts the TCP store at `cluster.rendezvous` and
coordinates; every (re)formation is one round:

1. each rank writes `lobby/<rank>`: a nonce, the generation it last belonged
   to, the step its dense state is at (None for a fresh process) and its
   fingerprint (config, world size, model shapes);
2. rank 0 collects all of them, refuses any whose fingerprint differs from its
   own (that process gets the reason and exits; the others keep waiting for a
   correct one until `cluster.rejoin_timeout_s`), and writes `plan/<nonce>`
   for each: the new generation (one above the highest any rank knew) and the
   source rank, the one whose state is newest;
3. every rank leaves its old process groups (a broken NCCL communicator is
   aborted, not destroyed) and joins the new generation's, under its own key
   prefix of the store: the default group for the dense tensors and, beside
   NCCL, a Gloo group for the CPU ones (`services.nn_worker.group.distributed.open_groups`).

A rank that dies takes its process group down: a survivor's next collective
raises (`is_group_failure`), the trainer calls `join` again with its step, and
the restarted process — started by `hybridrec run`, Compose's restart policy
or Kubernetes — calls `join` from its start. When rank 0 itself is replaced,
the new rank 0 hosts a new store at the same address and the survivors reach
it with a new client. When nobody holds state (the first start, or every rank
lost at once), the plan has no source: the group resumes from the newest
checkpoint, as before.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import secrets
import socket
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hybridrec.core.runtime import log
from hybridrec.core.config import ClusterConfig, Config, split_address
from services.nn_worker.group.distributed import close_groups, open_groups

POLL_S = 0.02
CONNECT_POLL_S = 0.01
"""How often a rank tries to reach rank 0's store before it has one (`Membership._await_listener`)."""
CONFIG_SECTIONS = ("features", "model", "optimizer", "training", "data")
"""What every rank must agree on (the cluster section differs per replica only in where it binds), with the
number of data loaders counted under data."""


class MembershipError(RuntimeError):
    """The group could not be (re)formed: refused, or not every rank came within the timeout."""


@dataclass(frozen=True)
class Fingerprint:
    """What a joining rank must share with the group to be let in."""

    config: str
    world_size: int
    model: str

    @classmethod
    def of(cls, config: Config, model: torch.nn.Module) -> "Fingerprint":
        tree = config.model_dump(mode="json")
        # The data's part of it includes how many data loaders feed the group (a rank has a stream per loader).
        tree["data"]["cluster.dataloader"] = len(config.cluster.dataloader)
        settings = json.dumps({k: tree[k] for k in CONFIG_SECTIONS}, sort_keys=True)
        shapes = json.dumps([[name, list(t.shape), str(t.dtype)] for name, t in model.state_dict().items()])
        return cls(hashlib.sha256(settings.encode()).hexdigest()[:16], len(config.cluster.nn_workers),
                   hashlib.sha256(shapes.encode()).hexdigest()[:16])

    def differences(self, other: "Fingerprint") -> list[str]:
        names = {"config": f"its config ({', '.join(CONFIG_SECTIONS)}) differs",
                 "world_size": f"its world size is {other.world_size}, the group's {self.world_size}",
                 "model": "its dense model has other parameter names, shapes or dtypes"}
        return [why for key, why in names.items() if getattr(self, key) != getattr(other, key)]


@dataclass(frozen=True)
class JoinRequest:
    nonce: str
    rank: int
    generation: int
    step: int | None
    fingerprint: Fingerprint

    @classmethod
    def parse(cls, raw: bytes) -> "JoinRequest":
        """A lobby entry as a joining rank writes it; ValueError naming what is wrong with anything else (the
        store is reachable by anything that can reach rank 0's port: its entries are checked like any input)."""
        try:
            tree = json.loads(raw)
            fingerprint = tree["fingerprint"]
            request = cls(tree["nonce"], tree["rank"], tree["generation"], tree["step"],
                          Fingerprint(fingerprint["config"], fingerprint["world_size"], fingerprint["model"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a join request ({type(exc).__name__}: {exc})") from None
        ints = [request.rank, request.generation, request.fingerprint.world_size,
                *([] if request.step is None else [request.step])]
        if not (isinstance(request.nonce, str) and 0 < len(request.nonce) <= 64 and request.nonce.isalnum()
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)
                and isinstance(request.fingerprint.config, str) and isinstance(request.fingerprint.model, str)):
            raise ValueError("a join request's fields are out of range or of the wrong type")
        return request


@dataclass(frozen=True)
class Plan:
    """Rank 0's answer to a join: the generation to form and where the dense state comes from."""

    generation: int
    source: int | None
    """Rank whose model, optimizer and step every rank adopts; None: nobody has state (resume from a checkpoint)."""
    step: int
    joined_fresh: tuple[int, ...] = ()
    """Ranks that joined without state (replacements), for the logs and the summary."""
    refused: str | None = None


def is_group_failure(exc: BaseException) -> bool:
    """A collective failed because a peer went away (and not, say, a shape error in the model)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo" in text.lower() or "Connection closed by peer" in text
                                              or "Connection reset by peer" in text)


def failure_line(exc: BaseException) -> str:
    """The first line of a collective's error, for a log field (Gloo's messages run to several lines)."""
    lines = str(exc).splitlines()
    return lines[0][:300] if lines else type(exc).__name__


class Membership:
    """This rank's view of the group: joins it at start and re-joins it after a failure."""

    def __init__(self, *, rank: int, world_size: int, rendezvous: str, fingerprint: Fingerprint, backend: str,
                 bind_host: str = "0.0.0.0", join_timeout_s: float = 600.0, collective_timeout_s: float = 600.0,
                 dense_timeout_s: float = 600.0, device: torch.device | None = None):
        self.rank, self.world_size = rank, world_size
        self.host, self.port = split_address(rendezvous)
        self.bind_host = bind_host
        self.fingerprint = fingerprint
        self.backend = backend
        self.device = device or torch.device("cpu")
        self.join_timeout = datetime.timedelta(seconds=join_timeout_s)
        self.collective_timeout = datetime.timedelta(seconds=collective_timeout_s)
        self.dense_timeout = datetime.timedelta(seconds=dense_timeout_s)
        self.generation = 0
        self.rounds = 0
        self._server = None  # rank 0: the store, kept for the life of the process
        self.log = log.get()

    @classmethod
    def from_config(cls, cluster: ClusterConfig, rank: int, fingerprint: Fingerprint, backend: str,
                    device: torch.device | None = None) -> "Membership":
        """From the `cluster` section, all that membership reads of the config (the rest of it is compared
        through the fingerprint)."""
        return cls(rank=rank, world_size=len(cluster.nn_workers), rendezvous=cluster.rendezvous,
                   fingerprint=fingerprint, backend=backend, bind_host=cluster.bind_host,
                   join_timeout_s=cluster.rejoin_timeout_s, collective_timeout_s=cluster.start_timeout_s * 5,
                   dense_timeout_s=cluster.dense_timeout_s, device=device)

    # -- the store ---------------------------------------------------------------------------------
    def _store(self) -> dist.Store:
        if self.rank == 0:
            if self._server is None:
                listener = socket.create_server((self.bind_host, self.port), backlog=1024, reuse_port=False)
                self._server = dist.TCPStore(self.host, self.port, None, True, timeout=self.join_timeout,
                                             wait_for_workers=False, multi_tenant=True,
                                             master_listen_fd=listener.fileno())
                listener.detach()  # the store owns the descriptor now
            return self._server
        # A new client every round: after rank 0 was replaced, the old connection leads nowhere.
        self._await_listener()
        return dist.TCPStore(self.host, self.port, None, False, timeout=self.join_timeout)

    def _await_listener(self) -> None:
        """Wait until rank 0's store accepts connections, trying every `CONNECT_POLL_S`.

        Why: a TCPStore client refused at its first try waits before the next with a back-off of its own: a rank
        that came up 20 ms before rank 0 (forked together, at a run's start) joined 0.35-0.75 s late. Gives up
        at the join timeout, leaving the client to report it."""
        deadline = time.monotonic() + self.join_timeout.total_seconds()
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), timeout=1.0).close()
                return
            except OSError:
                time.sleep(CONNECT_POLL_S)

    # -- a round -----------------------------------------------------------------------------------
    def join(self, step: int | None) -> Plan:
        """Blocking (the compute thread): one formation round; on return this rank is in the new group."""
        started = time.monotonic()
        close_groups()
        store = self._store()
        request = JoinRequest(secrets.token_hex(8), self.rank, self.generation, step, self.fingerprint)
        store.set(f"lobby/{self.rank}", json.dumps(asdict(request)))
        if self.rank == 0:
            self._coordinate(store)
        plan = Plan(**json.loads(store.get(f"plan/{request.nonce}")))
        if plan.refused:
            raise MembershipError(f"rank 0 refused this NN worker (rank {self.rank}): {plan.refused}")
        store.delete_key(f"plan/{request.nonce}")
        open_groups(self.backend, dist.PrefixStore(f"gen{plan.generation}", store), rank=self.rank,
                    world_size=self.world_size, device=self.device, dense_timeout=self.dense_timeout,
                    control_timeout=self.collective_timeout)
        self.generation = plan.generation
        self.rounds += 1
        self.log.info("group_formed", generation=plan.generation, source=plan.source, step=plan.step,
                      fresh=list(plan.joined_fresh), seconds=round(time.monotonic() - started, 3))
        return Plan(**{**asdict(plan), "joined_fresh": tuple(plan.joined_fresh)})

    def _coordinate(self, store: dist.Store) -> None:
        """Rank 0: wait for every rank's request, refuse strangers, hand out the plan."""
        deadline = time.monotonic() + self.join_timeout.total_seconds()
        joined: dict[int, JoinRequest] = {}
        refusals: list[str] = []
        while len(joined) < self.world_size:
            for rank in range(self.world_size):
                key = f"lobby/{rank}"
                if rank in joined or not store.check([key]):
                    continue
                raw = store.get(key)
                store.delete_key(key)
                try:
                    request = JoinRequest.parse(raw)
                except ValueError as exc:  # not a rank's: ignored, the group goes on waiting for that rank
                    self.log.warning("join_entry_malformed", key=key, reason=str(exc), entry=raw[:200].hex())
                    continue
                problems = self.fingerprint.differences(request.fingerprint)
                if problems or request.rank != rank:
                    reason = "; ".join(problems) or f"it wrote rank {rank}'s lobby entry as rank {request.rank}"
                    refusals.append(f"rank {rank}: {reason}")
                    self.log.warning("join_refused", rank=rank, reason=reason)
                    store.set(f"plan/{request.nonce}", json.dumps(asdict(Plan(0, None, 0, refused=reason))))
                    continue
                joined[rank] = request
            if len(joined) == self.world_size:
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(joined))
                raise MembershipError(
                    f"NN worker rank(s) {missing} did not join the group within cluster.rejoin_timeout_s="
                    f"{self.join_timeout.total_seconds():.0f}s" + (f"; refused: {'; '.join(refusals)}" if refusals
                                                                   else ""))
            time.sleep(POLL_S)
        holders = [r for r in joined.values() if r.step is not None]
        source = max(holders, key=lambda r: (r.step, -r.rank)) if holders else None
        plan = Plan(generation=max(r.generation for r in joined.values()) + 1,
                    source=source.rank if source else None, step=source.step if source else 0,
                    joined_fresh=tuple(r.rank for r in joined.values() if r.step is None))
        for request in joined.values():
            store.set(f"plan/{request.nonce}", json.dumps(asdict(plan)))
