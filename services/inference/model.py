"""What the inference service serves: an immutable `LoadedModel` behind a `ModelSource`.

A `LoadedModel` is one version of the model: manifest, dense module (eval mode,
never mutated after loading) and an embedding table. The batcher captures
`source.current()` once per micro-batch, so no response mixes two versions. A
`StaticSource` serves one bundle for the life of the process; a source that
follows published versions only has to swap what `current()` returns.

The embedding table is anything with `async lookup(ids_by_width)`: the
bundle's own tables in this process (`LocalTable`) or the bundle's read-only
PS shards over gRPC (`RemotePSTable`); both answer float32 rows, zeros for IDs
without one, so predictions are the same either way.
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Protocol, TypeVar

import numpy as np
import torch

from hybridrec.core.runtime import rpc
from hybridrec.core.layouts.bundle import BundleError, BundleManifest, EmbeddingTable, load_dense, open_bundle
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import ConfigError, FeatureKind
from hybridrec.core.wire.frames import PSLookup, PSRows
from hybridrec.core.model.models import build_model, feature_infos
from hybridrec.core.model.pooling import PooledEmbeddings, Pooler
from hybridrec.core.wire.sharding import split_by_shard
from hybridrec.core.model.tasks import answers
from services.inference.compiled import CompiledDense

if TYPE_CHECKING:
    from services.inference.inputs import Samples

T = TypeVar("T")


class Table(Protocol):
    async def lookup(self, ids_by_width: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """float32 (n, width) rows of each width's uint64 IDs; zeros for IDs without a row."""


class LocalTable:
    """The bundle's tables, memory-mapped in this process."""

    def __init__(self, table: EmbeddingTable):
        self.table = table

    async def lookup(self, ids_by_width: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        return {dim: self.table.lookup(dim, ids) for dim, ids in ids_by_width.items()}

    async def close(self) -> None:
        pass


class RemotePSTable:
    """Read-only PS shards (`hybridrec serve embedding_ps --bundle`, or a training PS): one `PSLookup`
    (train=False: nothing is inserted) per shard per micro-batch, in parallel, routed by `shard_of`."""

    def __init__(self, addresses: list[str], *, timeout_s: float, kappa: float = 1024.0):
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.values = ValueCodec(fp16=True, kappa=kappa)  # decodes float32 rows too
        self.channels = [rpc.channel(a) for a in self.addresses]
        self.calls = [rpc.raw_method(ch, "EmbeddingPS", "Lookup") for ch in self.channels]
        self.rpcs = 0

    async def lookup(self, ids_by_width: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        n = len(self.calls)
        plan: list[dict[int, np.ndarray]] = [{} for _ in range(n)]  # shard -> width -> positions
        for dim, ids in ids_by_width.items():
            for shard, positions in enumerate(split_by_shard(ids, n)):
                if positions.size:
                    plan[shard][dim] = positions

        async def one(shard: int) -> PSRows:
            request = PSLookup({d: ids_by_width[d][p] for d, p in plan[shard].items()}, train=False).encode()
            reply = await rpc.retry(lambda: self.calls[shard](request, timeout=self.timeout_s),
                                    deadline_s=self.timeout_s)
            return PSRows.decode(reply, self.values, {d: p.shape[0] for d, p in plan[shard].items()})

        shards = [s for s in range(n) if plan[s]]
        self.rpcs += len(shards)
        replies = await asyncio.gather(*(one(s) for s in shards))
        out = {dim: np.zeros((ids.shape[0], dim), np.float32) for dim, ids in ids_by_width.items()}
        for shard, reply in zip(shards, replies):
            for dim, positions in plan[shard].items():
                out[dim][positions] = reply.rows[dim]
        return out

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels), return_exceptions=True)


@dataclass(frozen=True)
class LoadedModel:
    """One servable version: never mutated once built (a new version is a new LoadedModel)."""

    version: int
    step: int
    manifest: BundleManifest
    model: torch.nn.Module
    table: Table
    pooler: Pooler
    outputs: int
    """Logits per sample: 1 gives probability (batch,), more give (batch, outputs)."""
    compiled: CompiledDense | None = None
    """The dense forward in ONNX Runtime (the inference service's), or None: PyTorch, eagerly."""

    def forward(self, dense: np.ndarray, bags) -> np.ndarray:
        """float32 answers (batch,) or (batch, outputs) of one micro-batch (bags: rows filled in): a binary
        task's probability, a regression task's value (`hybridrec.core.model.tasks.answers`)."""
        if self.compiled is not None:
            probs = self.compiled(dense, self.pooler.pool_host(bags))
        else:
            with torch.inference_mode():
                _, pooled = self.pooler.pool(bags, torch.device("cpu"), grad=False)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.manifest.precision == "bf16"):
                    logits = self.model(torch.from_numpy(dense), pooled)
                probs = answers(logits, self.manifest.task_heads).numpy()
        if probs.ndim == 2 and probs.shape[1] == 1:
            probs = probs[:, 0]
        return probs

    async def predict(self, samples: "Samples", *,
                      compute: Callable[..., Awaitable[np.ndarray]] | None = None) -> np.ndarray:
        """float32 probabilities of `samples` (any input form): the lookup, pooling and forward of every
        micro-batch, whoever batched it. `compute(fn, *args)` runs the forward elsewhere (the batcher's compute
        thread); None: here, and samples of scalar features are looked up as columns (`forward_columns`).
        With a local table nothing here waits for I/O, so a caller without an event loop can drive it to the
        end at once (`run_now`)."""
        if compute is None and samples.columns is not None and self.takes_columns:
            return await self.forward_columns(samples.dense, *samples.columns)
        uniq, bags = self.pooler.from_bags(samples.bags)
        bags.rows = await self.table.lookup(uniq)
        dense = np.ascontiguousarray(samples.dense)
        if compute is None:
            return self.forward(dense, bags)
        return await compute(self.forward, dense, bags)

    @functools.cached_property
    def takes_columns(self) -> bool:
        """Whether `forward_columns` can answer: the compiled forward over scalar features of one width."""
        features = self.manifest.features
        return (self.compiled is not None and len(self.pooler.dims) == 1
                and not any(f.sequence or f.kind == FeatureKind.LIST for f in features))

    async def forward_columns(self, dense: np.ndarray, ids: np.ndarray, present: np.ndarray) -> np.ndarray:
        """`forward` of samples whose every feature is one ID or none (`takes_columns`): a bag of at most one
        row pools to that row under every pooling, so the rows of the (n, F) IDs, looked up as they are, are
        the pooled block itself, zeros where a feature is absent; no unique IDs, no bag plan."""
        (dim,) = self.pooler.dims
        n, features = ids.shape
        rows = (await self.table.lookup({dim: np.ascontiguousarray(ids).reshape(-1)}))[dim]
        block = rows.reshape(n, features, dim)
        if not present.all():
            block[~present] = 0.0
        pooled = PooledEmbeddings()
        pooled.blocks.append((tuple(self.pooler.names), block))
        probs = self.compiled(np.ascontiguousarray(dense), pooled)
        return probs[:, 0] if probs.ndim == 2 and probs.shape[1] == 1 else probs


def run_now(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (`LoadedModel.predict` on a local table), driven without an
    event loop: the Triton backend's path, where an event loop's turn would cost more than the lookup."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("run_now: the coroutine waited for I/O (a remote table needs an event loop)")


class ModelSource(Protocol):
    def current(self) -> LoadedModel:
        """The version to answer the next micro-batch with."""


class StaticSource:
    """One bundle, loaded once."""

    def __init__(self, model: LoadedModel):
        self.model = model

    def current(self) -> LoadedModel:
        return self.model


def build_dense(manifest: BundleManifest, state_dict: dict) -> torch.nn.Module:
    """The bundle's (or a published version's) dense module with its weights, in eval mode, without gradients:
    what every way of serving runs (an export, a followed version, Triton's backend)."""
    model = build_model(manifest.model.path, feature_infos(manifest.features),
                        manifest.num_dense, manifest.model.kwargs,
                        num_tasks=manifest.num_tasks)
    model.load_state_dict(state_dict)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_model(path: str | Path, *, table: Table | None = None, check: bool = True,
               compile: bool = False) -> LoadedModel:
    """A LoadedModel from bundle directory `path`; `table` replaces the bundle's own embedding tables;
    `compile`: the dense forward in ONNX Runtime where it answers as the model does (`CompiledDense`)."""
    manifest, local = open_bundle(Path(path), check=check)
    if manifest.base_version is not None:
        raise BundleError(f"{Path(path) / 'manifest.json'}: a delta on version {manifest.base_version} (a live "
                          f"version), not a whole model: serve its versions directory with --follow")
    model = build_dense(manifest, load_dense(Path(path)))
    if table is None:
        table = LocalTable(local)
    elif isinstance(table, RemotePSTable) and len(table.addresses) != manifest.num_shards:
        raise ConfigError(f"ps: lists {len(table.addresses)} shard(s); the bundle {path} has "
                         f"{manifest.num_shards}: give one address per shard, in shard order")
    return assemble(manifest, model, table, compile=compile)


def assemble(manifest: BundleManifest, model: torch.nn.Module, table: Table, *,
             compile: bool = False) -> LoadedModel:
    """A LoadedModel of a built dense module and a table (a bundle's, or a followed version's merged one);
    `compile` as in `load_model`."""
    pooler = Pooler(manifest.features, ValueCodec(fp16=False))
    # One zero sample tells how many logits the model answers per sample.
    bags = pooler.from_columns(np.zeros((1, len(manifest.features)), np.uint64),
                               np.zeros((1, len(manifest.features)), bool))[1]
    bags.rows = {d: np.zeros((0, d), np.float32) for d in pooler.dims}
    probe = LoadedModel(manifest.version, manifest.step, manifest, model, table, pooler, 1)
    out = probe.forward(np.zeros((1, manifest.num_dense), np.float32), bags)
    outputs = 1 if out.ndim == 1 else int(out.shape[1])
    compiled = None
    if compile:
        compiled = CompiledDense.build(model, pooler.pool_host(bags), manifest.num_dense,
                                       precision=manifest.precision, heads=tuple(manifest.task_heads))
    return LoadedModel(manifest.version, manifest.step, manifest, model, table, pooler, outputs, compiled)
