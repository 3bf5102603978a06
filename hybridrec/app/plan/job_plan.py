"""A job's plan as data: what runs where, made once from the config (fitted to the host) and printable.

`JobPlan.of(config, layout)` lists every replica of every service with its host, port and part of the job (PS
shards and the widths and rows each holds; NN ranks, their backend and threads; data loaders; embedding
workers), the PS stores, and the memory, store files and disk one PS shard needs (`hybridrec.app.plan.memory`).
`hybridrec run` writes it to the run directory as `plan.json` once the services' ports are chosen, before
any starts; `hybridrec plan --config` prints the same table from a config. Plain frozen dataclasses: the plan
holds no process, socket or file, so anything that reads `plan.json` gets the same picture.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridrec.core.config import Config, split_address

PLAN_FILE = "plan.json"
SERVICES = ("dataloader", "embedding_worker", "embedding_ps", "nn_worker")
"""In the order the plan lists them: the data flows from the first to the last."""
_ADDRESSES = {"dataloader": "dataloader", "embedding_worker": "embedding_workers", "embedding_ps": "ps",
              "nn_worker": "nn_workers"}


@dataclass(frozen=True)
class Placement:
    """One replica of a service: where it listens and what part of the job it holds."""

    service: str
    replica: int
    host: str
    port: int
    """0: chosen when the job starts (a local run's loopback ports)."""
    role: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class StorePlan:
    """The store of one embedding width on every PS shard."""

    dim: int
    rows_per_shard: int
    """In memory (ps.capacity)."""
    disk_rows_per_shard: int
    """On the disk tier (ps.tier.capacity); 0: no tier."""
    stripes: int


@dataclass(frozen=True)
class JobPlan:
    layout: str
    """How the replica counts were chosen (`hybridrec.app.plan.layout.Layout.line`), or "as configured"."""
    mode: str
    backend: str
    torch_threads: int | str
    """Per NN worker ("auto" in a plan of a config not fitted to a host)."""
    services: tuple[Placement, ...]
    stores: tuple[StorePlan, ...]
    ps_memory_bytes: int
    """All one PS shard holds in memory: its store files and its private arrays (`plan.plan_config`)."""
    ps_files_bytes: int
    """Of it, the store files (under ps.shm_dir)."""
    ps_disk_bytes: int
    """Its disk tier's file (under ps.tier.dir); 0: no tier."""

    @classmethod
    def of(cls, config: Config, layout=None) -> "JobPlan":
        """The plan of `config` (its replica lists and threads sized already: `layout.fit`); `layout`: how they
        were chosen, for the record."""
        from hybridrec.app.plan.memory import plan_config

        memory = plan_config(config)
        stores = tuple(StorePlan(s["dim"], s["rows_per_shard"], s["disk_rows_per_shard"], s["stripes"])
                       for s in memory["stores"])
        return cls(layout=layout.line() if layout is not None else "as configured",
                   mode=config.training.mode.value, backend=str(config.training.backend),
                   torch_threads=config.training.torch_threads,
                   services=tuple(_placements(config, stores)), stores=stores,
                   ps_memory_bytes=memory["per_shard_memory_bytes"], ps_files_bytes=memory["per_shard_bytes"],
                   ps_disk_bytes=memory["per_shard_disk_bytes"])

    def of_service(self, service: str) -> list[Placement]:
        return [p for p in self.services if p.service == service]

    def lines(self) -> list[str]:
        """The plan as a table: one line per replica, then the PS's stores and memory."""
        from hybridrec.app.plan.memory import human

        out = [f"job: {self.mode} mode, {self.backend} backend, {self.torch_threads} torch thread(s) per NN worker; "
               f"{self.layout}"]
        addresses = [f"{p.host}:{p.port if p.port else '(chosen at start)'}" for p in self.services]
        width, where = max(len(p.service) for p in self.services), max(len(a) for a in addresses)
        for p, address in zip(self.services, addresses):
            out.append(f"  {p.service:<{width}} {p.replica:>3}  {address:<{where}}  {p.role}")
        for s in self.stores:
            disk = f", {s.disk_rows_per_shard:,} on disk" if s.disk_rows_per_shard else ""
            out.append(f"  store of width {s.dim}: {s.rows_per_shard:,} rows per shard in memory{disk}, "
                       f"{s.stripes} stripes")
        disk = f", {human(self.ps_disk_bytes)} of disk tier" if self.ps_disk_bytes else ""
        out.append(f"  a PS shard needs {human(self.ps_memory_bytes)} of memory ({human(self.ps_files_bytes)} of it "
                   f"in store files){disk}")
        return out

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "JobPlan":
        fields = {**data, "services": tuple(Placement(**p) for p in data["services"]),
                  "stores": tuple(StorePlan(**s) for s in data["stores"])}
        return cls(**fields)

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / PLAN_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, run_dir: Path) -> "JobPlan":
        return cls.from_json(json.loads((Path(run_dir) / PLAN_FILE).read_text()))


def _placements(config: Config, stores: tuple[StorePlan, ...]) -> list[Placement]:
    cluster = config.cluster
    placements = []
    for service in SERVICES:
        addresses = getattr(cluster, _ADDRESSES[service])
        for replica, address in enumerate(addresses):
            host, port = split_address(address)
            placements.append(Placement(service, replica, host, port,
                                        _role(config, service, replica, len(addresses), stores)))
    return placements


def _role(config: Config, service: str, replica: int, count: int, stores: tuple[StorePlan, ...]) -> str:
    if service == "embedding_ps":
        widths = ", ".join(f"width {s.dim}" for s in stores)
        return f"shard {replica} of {count}: {widths}"
    if service == "nn_worker":
        return f"rank {replica} of {count}"
    if service == "dataloader":
        source = "the stream" if config.data.stream is not None else "its split of the data"
        return f"loader {replica} of {count}: {source}"
    return f"worker {replica} of {count}: buffers batches, routes lookups and updates to the PS shards"
