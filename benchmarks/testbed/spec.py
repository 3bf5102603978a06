"""The testbed spec: hosts (network namespaces), which services run on each, and each host's link rates.

Validated before anything is created: an unknown service, a rate that is not a
positive bit rate, a host without services, a replica placed twice or not at
all are refused with a message naming the host and the entry.
"""
from __future__ import annotations

import os
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridrec.core.runtime.service import SERVICES

RATE_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")


class SpecError(ValueError):
    """The testbed spec is not valid; the message names what is wrong."""


def parse_rate(value: Any) -> float | None:
    """A bit rate in bit/s from 4e9, "4gbit", "250mbit", "500kbit"; None for None/"unshaped"/"inf"."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "unshaped", "inf")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"rate {value!r} is not a bit rate")
    if isinstance(value, (int, float)):
        bits = float(value)
    else:
        match = _RATE.match(str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in RATE_UNITS:
            raise ValueError(f"rate {value!r} is not a bit rate (e.g. 4gbit, 250mbit, 1e9, unshaped)")
        bits = float(match.group(1)) * RATE_UNITS[unit]
    if not bits > 0 or bits != bits or bits == float("inf"):
        raise ValueError(f"rate {value!r} must be a positive bit rate")
    if bits < 8_000:
        raise ValueError(f"rate {value!r} is below 8 kbit/s: tbf cannot shape it")
    return bits


def parse_cpus(text: str) -> set[int]:
    """{0, 1, 3} from "0-1,3"; ValueError for a malformed list or a CPU this machine does not let us use."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"cpus {text!r}: expected a list like 0, 0-3 or 0,2")
        cpus.update(range(int(first), int(last if dash else first) + 1))
    usable = os.sched_getaffinity(0)
    if not cpus <= usable:
        raise ValueError(f"cpus {text!r}: CPU {sorted(cpus - usable)} is not available here "
                         f"(usable: {sorted(usable)})")
    return cpus


def split_cpus() -> tuple[str, str] | None:
    """Two disjoint halves of the usable CPUs, (trainer, embedding), the trainer taking the larger; None with
    a single CPU."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        return None
    half = (len(usable) + 1) // 2
    return ",".join(map(str, usable[:half])), ",".join(map(str, usable[half:]))


def cpus_option(choice: str | None) -> tuple[str, str] | None:
    """(trainer, embedding) CPU lists from a command line's --cpus: 'split' (`split_cpus`), 'shared' or None
    (every CPU for both), or TRAINER/EMBEDDING lists such as 0/1."""
    if choice in (None, "shared"):
        return None
    if choice == "split":
        return split_cpus()
    trainer, sep, embedding = choice.partition("/")
    if not sep or not trainer or not embedding:
        raise ValueError(f"--cpus {choice!r}: expected split, shared or TRAINER/EMBEDDING CPU lists (e.g. 0/1)")
    return trainer, embedding


def format_rate(bits: float | None) -> str:
    if bits is None:
        return "unshaped"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


class LinkSpec(BaseModel):
    """A host's link to the bridge; each direction shaped by tbf on the sending end (None: unshaped)."""

    model_config = ConfigDict(extra="forbid")

    up: float | None = None
    """Host -> bridge rate in bit/s (egress of the host's eth0)."""
    down: float | None = None
    """Bridge -> host rate in bit/s (egress of the bridge's port to the host)."""

    @field_validator("up", "down", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> float | None:
        return parse_rate(value)


class HostSpec(BaseModel):
    """One host: a network namespace with one address and the services that run in it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """Short name ([a-z][a-z0-9]*, at most 10 characters: it is part of interface and namespace names)."""
    services: Annotated[list[str], Field(min_length=1)]
    """`SERVICE` (every replica of it) or `SERVICE:REPLICA`."""
    link: LinkSpec = Field(default_factory=LinkSpec)
    cpus: str | None = None
    """The CPUs the host's processes run on, as `taskset -c` writes them ("0", "0-3", "0,2"); None: every
    CPU. Separate machines have separate cores: pinning keeps one host's work (the embedding host's gRPC, PS
    and embedding worker) off another's (the trainer's dense compute), as it would be off it across a real
    network. Hosts may share CPUs; every CPU must exist here."""

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, cpus: str | None) -> str | None:
        if cpus is not None:
            parse_cpus(cpus)
        return cpus

    def cpu_set(self) -> set[int] | None:
        return parse_cpus(self.cpus) if self.cpus is not None else None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _HOST_NAME.match(name):
            raise ValueError(f"host name {name!r}: use [a-z][a-z0-9]*, at most 10 characters")
        return name

    @field_validator("services")
    @classmethod
    def _services(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            service, _, replica = entry.partition(":")
            if service not in SERVICES:
                raise ValueError(f"unknown service {service!r} (in {entry!r}); expected one of {', '.join(SERVICES)}")
            if replica and not replica.isdigit():
                raise ValueError(f"{entry!r}: the replica after ':' must be a number")
        return entries

    def placements(self) -> list[tuple[str, int | None]]:
        out = []
        for entry in self.services:
            service, _, replica = entry.partition(":")
            out.append((service, int(replica) if replica else None))
        return out


class TestbedSpec(BaseModel):
    """Hosts connected through one bridge namespace; every replica of every service on exactly one host."""

    __test__ = False  # not a pytest class
    model_config = ConfigDict(extra="forbid")

    hosts: Annotated[list[HostSpec], Field(min_length=1)]
    subnet: str = "10.77.0"
    """First three octets of the /24 the hosts get addresses from (host i: .i+1)."""

    @model_validator(mode="after")
    def _unique(self) -> "TestbedSpec":
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        if len(self.hosts) > 250:
            raise ValueError("at most 250 hosts")
        if not re.match(r"^10\.\d{1,3}\.\d{1,3}$", self.subnet):
            raise ValueError(f"subnet {self.subnet!r}: give three octets of a 10.x.y network, e.g. 10.77.0")
        return self

    def address(self, host: str) -> str:
        return f"{self.subnet}.{[h.name for h in self.hosts].index(host) + 1}"

    def assign(self, replicas: dict[str, int]) -> dict[tuple[str, int], str]:
        """(service, replica) -> host, for `replicas[service]` replicas of each; SpecError if any is placed
        twice, not at all, or does not exist."""
        where: dict[tuple[str, int], str] = {}
        for host in self.hosts:
            for service, replica in host.placements():
                wanted = range(replicas[service]) if replica is None else [replica]
                if replica is not None and replica >= replicas[service]:
                    raise SpecError(f"host {host.name}: {service}:{replica} does not exist (the config has "
                                    f"{replicas[service]} replica(s))")
                for r in wanted:
                    if (service, r) in where:
                        raise SpecError(f"{service}:{r} is placed on both {where[(service, r)]} and {host.name}")
                    where[(service, r)] = host.name
        missing = [f"{s}:{r}" for s, n in replicas.items() for r in range(n) if (s, r) not in where]
        if missing:
            raise SpecError(f"not placed on any host: {', '.join(missing)}")
        return where


def load_spec(tree: dict[str, Any]) -> TestbedSpec:
    try:
        return TestbedSpec.model_validate(tree)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {where or 'spec'}: {err['msg'].removeprefix('Value error, ')}")
        raise SpecError("invalid testbed spec:\n" + "\n".join(lines)) from None


def two_hosts(rate: Any = None, trainer_rate: Any = None, cpus: tuple[str, str] | None = None, *,
              loader_host: bool = False) -> TestbedSpec:
    """The default: `trainer` (data loader, NN workers) and `embedding` (PS shards, embedding workers);
    `rate` shapes the embedding host's link both ways, `trainer_rate` the trainer's; `cpus` pins the two
    hosts to (trainer, embedding) CPU lists (`split_cpus()` halves this machine).

    `loader_host` puts the data loader on a third host, `data` (unshaped link, the embedding host's CPUs), as
    Persia deploys its data loaders: the trainer's CPUs then run only the NN workers, which stand for GPU
    machines whose time goes to the dense step."""
    trainer_cpus, embedding_cpus = cpus or (None, None)
    hosts = [
        {"name": "trainer", "services": ["nn_worker"] if loader_host else ["dataloader", "nn_worker"],
         "link": {"up": trainer_rate, "down": trainer_rate}, "cpus": trainer_cpus},
        {"name": "embedding", "services": ["embedding_ps", "embedding_worker"], "link": {"up": rate, "down": rate},
         "cpus": embedding_cpus},
    ]
    if loader_host:
        hosts.append({"name": "data", "services": ["dataloader"], "cpus": embedding_cpus})
    return load_spec({"hosts": hosts})
