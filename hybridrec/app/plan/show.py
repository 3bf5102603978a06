"""What `hybridrec plan` answers and how it prints it: the plan a run started with (its plan.json), or the
memory plan of a config's job on this host (with the job's plan and the largest capacity this host holds), of
tables given by their sizes, or of the fewest PS hosts of a given memory that hold them (memory.py computes the
figures). A bad option or a plan that cannot hold is a ValueError whose message the CLI prints."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybridrec.core.config import EmbeddingOptimizer


@dataclass(frozen=True)
class PlanRequest:
    """The options of `hybridrec plan`, as given (see its --help)."""

    config_path: Optional[Path] = None
    run_dir: Optional[Path] = None
    ids: Optional[float] = None
    params: Optional[float] = None
    dim: int = 16
    table: Optional[list[str]] = None
    optimizer: str = EmbeddingOptimizer.ADAGRAD.value
    storage: str = "fp32"
    shards: int = 2
    host_memory: Optional[str] = None
    changed: float = 0.1
    interval_s: float = 30.0
    admit_after: int = 1
    sketch_width: int = 1 << 22
    sketch_depth: int = 4
    ttl: bool = False
    as_json: bool = False


def answer(request: PlanRequest) -> str:
    """The text `hybridrec plan` prints for `request` (JSON with --json)."""
    from hybridrec.app.plan.job_plan import PLAN_FILE, JobPlan

    if request.run_dir is not None:
        if not (request.run_dir / PLAN_FILE).is_file():
            raise ValueError(f"--run-dir {request.run_dir}: no {PLAN_FILE} there (a run directory of `hybridrec "
                             f"run` has one)")
        job = JobPlan.read(request.run_dir)
        return json.dumps(job.to_json(), indent=2) if request.as_json else "\n".join(job.lines())
    if request.storage not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"--storage {request.storage}: one of fp32, fp16, bf16 (ps.storage)")
    result = compute(request)
    return json.dumps(result, indent=2) if request.as_json else "\n".join(lines(result))


def compute(request: PlanRequest) -> dict:
    """The plan's figures: of --config's job on this host, or of the tables given; what checkpoints write."""
    from hybridrec.app.plan import memory as planner

    if request.config_path is not None:
        result = _config_plan(request.config_path)
    else:
        if sum(x is not None and x != [] for x in (request.ids, request.params, request.table)) != 1:
            raise ValueError("give one of --ids, --params or --table (or --config)")
        tables = [parse_table(t) for t in request.table] if request.table else \
            [planner.Table(int(request.ids if request.ids is not None else request.params / request.dim),
                           request.dim)]
        options = dict(optimizer=request.optimizer, admit_after=request.admit_after, ttl=request.ttl,
                       sketch_width=request.sketch_width, sketch_depth=request.sketch_depth, storage=request.storage)
        result = (planner.hosts_for(tables, host_bytes=parse_bytes(request.host_memory, "--host-memory"), **options)
                  if request.host_memory else planner.plan_tables(tables, shards=request.shards, **options))
    result["checkpoint"] = planner.checkpoint_bytes(result, changed=request.changed, interval_s=request.interval_s)
    return result


def _config_plan(config_path: Path) -> dict:
    """A config's job fitted to this host: its PS plan, layout, job plan and the largest capacity here."""
    from hybridrec.core.config import load_config
    from hybridrec.app.plan import memory as planner
    from hybridrec.app.plan.job_plan import JobPlan
    from hybridrec.app.run.preflight import fit_to_host

    config, layout = fit_to_host(load_config(config_path, []))
    result = planner.plan_config(config) | {"layout": layout.line(), "job": JobPlan.of(config, layout).to_json()}
    result["largest_capacity_here"] = planner.largest_capacity(
        config, result["shards"], planner.host_memory_bytes(), planner.free_bytes(config.ps.shm_dir))
    return result


def lines(result: dict) -> list[str]:
    """The plan for people: the job's plan (with --config), each shard's parts, memory, disk, hosts, checkpoints."""
    from hybridrec.app.plan.job_plan import JobPlan
    from hybridrec.app.plan.memory import human as h

    out = ["\n".join(JobPlan.from_json(result["job"]).lines())] if "job" in result else []
    out.append(f"PS shards: {result['shards']}   optimizer: {result['optimizer']}   "
               f"weights: {result.get('storage', 'fp32')}   "
               f"rows per shard: {result['rows_per_shard']:,}")
    out += [f"  {name:<8} {h(nbytes):>14} per shard" for name, nbytes in result["per_shard_parts"].items()]
    if len(result["stores"]) > 1:
        out += [f"  width {store['dim']:<4} {store['rows_per_shard']:>14,} rows "
                f"{h(store['per_shard_bytes']):>14} per shard" for store in result["stores"]]
    private = result["per_shard_private"]
    out.append(f"store files per shard: {h(result['per_shard_bytes'])}   total: {h(result['total_bytes'])}")
    out.append(f"private per shard: {h(private['stamps_and_marks'])} of stamps and change marks, "
               f"{h(private['checkpoint_buffers'])} of checkpoint buffers while a dump runs"
               + (f", {h(private['disk_tier_marks'])} of the disk tier's change marks"
                  if private.get("disk_tier_marks") else ""))
    out.append(f"memory per shard: {h(result['per_shard_memory_bytes'])}   total: {h(result['total_memory_bytes'])}")
    return out + _tail_lines(result)


def _tail_lines(result: dict) -> list[str]:
    """The disk tier, the hosts, the checkpoints, the layout and the largest capacity, those the plan has."""
    from hybridrec.app.plan.memory import human as h

    out = []
    if result.get("per_shard_disk_bytes"):
        out.append(f"disk tier per shard: {result['disk_rows_per_shard']:,} rows, "
                   f"{h(result['per_shard_disk_bytes'])} at full capacity   total: {h(result['total_disk_bytes'])}")
    if "hosts" in result:
        out.append(f"hosts of {h(result['host_bytes'])}: {result['hosts']:,} ({result['shards_per_host']} "
                   f"shard(s) each)")
    c = result["checkpoint"]
    out.append(f"checkpoints: a full dump writes {h(c['full_per_shard'])} per shard ({h(c['full_total'])} in all); "
               f"a delta of {c['changed_share']:.0%} changed rows {h(c['delta_per_shard'])} per shard, "
               f"{h(c['delta_bandwidth_per_shard'])}/s at one every {c['interval_s']:g} s")
    if "layout" in result and "job" not in result:  # the job's plan above says it
        out.append(f"layout on this host: {result['layout']}")
    if "largest_capacity_here" in result:
        out.append(f"largest ps.capacity this host holds with this layout: {result['largest_capacity_here']:,} "
                   f"rows per width per shard")
    return out


def parse_bytes(text: str, option: str) -> int:
    """`12TiB`, `24GB`, `1e12` as bytes (binary units for KiB..PiB, decimal for KB..PB)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
    number = text.strip().rstrip("bBiIkKmMgGtTpP")
    try:
        value = float(number) * units[text.strip()[len(number):].upper()]
    except (ValueError, KeyError):
        raise ValueError(f"{option} {text!r}: expected a size such as 12TiB, 512GiB or 1e12") from None
    if value <= 0:
        raise ValueError(f"{option} {text!r}: must be positive")
    return int(value)


def parse_table(spec: str):
    """`--table IDS:DIM` (IDS may be written 1e9) as the planner's Table."""
    from hybridrec.app.plan.memory import Table

    try:
        ids, dim = spec.split(":")
        return Table(int(float(ids)), int(dim))
    except ValueError:
        raise ValueError(f"--table {spec!r}: expected IDS:DIM, e.g. 1e9:16") from None
