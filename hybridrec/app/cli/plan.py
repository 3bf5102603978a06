"""`hybridrec plan`: what a job needs before it runs — the bytes a PS shard holds and its checkpoints write,
the job's plan on this host, or the plan a run started with. The figures and the text are
hybridrec/app/plan/show.py's (from memory.py, job_plan.py and layout.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hybridrec.core.config import EmbeddingOptimizer
from hybridrec.app.cli.common import fail

commands = typer.Typer()
"""The top-level commands of this group (hybridrec/app/cli/__init__.py adds them to the app)."""


@commands.command()
def plan(config_path: Optional[Path] = typer.Option(None, "--config", help="Plan this config's job on this host."),
         run_dir: Optional[Path] = typer.Option(None, "--run-dir",
                                                help="Show the plan a `hybridrec run` wrote (its plan.json)."),
         ids: Optional[float] = typer.Option(None, "--ids", help="Distinct IDs (rows) in all tables, e.g. 1e9."),
         params: Optional[float] = typer.Option(None, "--params", help="Or: embedding parameters (ids x dim)."),
         dim: int = typer.Option(16, "--dim", min=1, help="Embedding width."),
         table: Optional[list[str]] = typer.Option(None, "--table",
                                                   help="IDS:DIM, once per table (tables of their own widths), "
                                                        "e.g. --table 1e9:16 --table 2e7:64; instead of --ids."),
         optimizer: str = typer.Option(EmbeddingOptimizer.ADAGRAD.value, "--optimizer",
                                       help=" | ".join(m.value for m in EmbeddingOptimizer)),
         storage: str = typer.Option("fp32", "--storage", help="Weights: fp32 | fp16 | bf16 (ps.storage: 16-bit "
                                                                  "weights, two a word; the state stays float32)."),
         shards: int = typer.Option(2, "--shards", min=1, help="PS shards (unless --host-memory is given)."),
         host_memory: Optional[str] = typer.Option(None, "--host-memory",
                                                   help="Memory of a PS host, e.g. 12TiB: plan the fewest shards "
                                                        "and hosts that hold the tables instead of --shards."),
         changed: float = typer.Option(0.1, "--changed", min=0.0, max=1.0,
                                       help="Share of the rows an incremental checkpoint finds changed."),
         interval_s: float = typer.Option(30.0, "--interval-s", min=0.001, help="Seconds between checkpoints."),
         admit_after: int = typer.Option(1, "--admit-after", min=1, max=255,
                                         help="Occurrences before an ID gets a row (> 1: a count-min sketch)."),
         sketch_width: int = typer.Option(1 << 22, "--sketch-width", help="Sketch counters per row per store."),
         sketch_depth: int = typer.Option(4, "--sketch-depth", min=1, max=8, help="Sketch rows."),
         ttl: bool = typer.Option(False, "--ttl", help="Rows expire by age (16 bytes of stamps per row)."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Every byte a PS shard holds (store files, private arrays, a checkpoint's buffers), per shard and in total;
    what its checkpoints write; with --config, the job's plan (every replica's address and part) and the
    largest capacity this host holds; with --run-dir, the plan a run started with; with --host-memory, the
    hosts a table needs."""
    from hybridrec.app.plan.show import PlanRequest, answer

    request = PlanRequest(config_path=config_path, run_dir=run_dir, ids=ids, params=params, dim=dim, table=table,
                          optimizer=optimizer, storage=storage, shards=shards, host_memory=host_memory,
                          changed=changed, interval_s=interval_s, admit_after=admit_after,
                          sketch_width=sketch_width, sketch_depth=sketch_depth, ttl=ttl, as_json=as_json)
    try:
        text = answer(request)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(text)
