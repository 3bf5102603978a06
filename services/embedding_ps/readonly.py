"""`hybridrec serve embedding_ps --bundle DIR --replica N`: one shard of a model bundle, read-only.

Serves the PS protocol from a bundle (hybridrec/core/layouts/bundle.py) instead of a
training store: `Lookup` answers a `PSLookup` with `PSRows` read from the
bundle's memory-mapped, sorted keys and rows (zeros for IDs without a row;
IDs of another shard are refused, as the training PS does); `Update`,
`Checkpoint` and `LoadCheckpoint` are refused with FAILED_PRECONDITION;
`Stats` reports rows per width. Nothing is loaded at start-up beyond the
mapping, so a shard bigger than RAM still serves.

It needs no training config: `ReadOnlyPSSettings` is all it reads (the CLI
fills it from its flags). Every file of the bundle is verified against its
sha256 before the health check turns SERVING; a bad bundle, or a replica the
bundle has no shard for, is a `BundleError` naming the file (exit 2 from the
CLI).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import grpc
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hybridrec.core.layouts.bundle import BundleError, BundleManifest, ShardTable, read_manifest, verify
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.config import TLSConfig, split_address
from hybridrec.core.wire.frames import PSLookup, PSRows
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime.rpc import FailedPrecondition, Unavailable
from hybridrec.core.runtime.service import ServiceHost
from hybridrec.core.wire.sharding import shard_of


class ReadOnlyPSSettings(BaseModel):
    """Everything a read-only PS shard needs: no training config (and no data files) involved."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bundle: Path
    """The bundle directory (`hybridrec export --out`)."""
    replica: Annotated[int, Field(ge=0)]
    """Which shard of the bundle to serve (must be below the bundle's num_shards)."""
    listen: str = "127.0.0.1:0"
    """gRPC HOST:PORT to bind; port 0 picks a free one (logged as `listening`)."""
    metrics_port: Annotated[int, Field(ge=0, lt=65536)] = 0
    """Prometheus HTTP port (0: none)."""
    fp16: bool = False
    """Send rows κ-scaled fp16 (as training.compression.fp16 does); off sends float32, which every client decodes."""
    kappa: Annotated[float, Field(gt=0, le=60000)] = 1024.0
    """Norm each row is scaled to before the fp16 cast."""
    threads: Annotated[int, Field(ge=1, le=64)] = 2
    """Request threads running the lookups."""
    tls: TLSConfig | None = None
    """Mutual TLS, as cluster.tls of a training job (None: plaintext)."""

    @field_validator("listen")
    @classmethod
    def _address(cls, value: str) -> str:
        split_address(value)
        return value


class ReadOnlyPSServicer:
    """Registered before the server starts; answers UNAVAILABLE until `attach` maps the verified shard."""

    def __init__(self, bundle: Path, shard: int, values: ValueCodec, executor: ThreadPoolExecutor):
        self.bundle, self.shard, self.values, self.executor = bundle, shard, values, executor
        self.table: ShardTable | None = None
        self.manifest: BundleManifest | None = None
        self.num_shards = 0
        self.counters = {"lookups_total": 0, "rows_looked_up_total": 0, "rows_found_total": 0, "refused_total": 0}

    def attach(self, manifest: BundleManifest, table: ShardTable) -> None:
        self.manifest, self.table, self.num_shards = manifest, table, manifest.num_shards

    def stats(self) -> dict[str, float]:
        """Request counters and, per width, the rows this shard holds (read at every metrics scrape)."""
        values: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        values["read_only"] = 1.0
        if self.table is not None:
            for dim, keys in self.table.keys.items():
                values[f"dim{dim}_rows"] = float(keys.shape[0])
        return values

    def _check_shard(self, ids: np.ndarray) -> np.ndarray:
        if ids.size and not np.all(shard_of(ids, self.num_shards) == self.shard):
            raise ValueError(f"request holds IDs of another shard; this is shard {self.shard} of {self.num_shards}")
        return ids

    def _lookup(self, dim: int, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """(rows, how many IDs had one): ShardTable.lookup's binary search, counting the hits."""
        keys = self.table.keys[dim]
        out = np.zeros((ids.shape[0], dim), np.float32)
        if keys.shape[0] == 0 or ids.shape[0] == 0:
            return out, 0
        at = np.minimum(np.searchsorted(keys, ids), keys.shape[0] - 1)
        hit = keys[at] == ids
        out[hit] = self.table.rows_at(dim, at[hit])  # dequantized from a quantized bundle's int8
        return out, int(np.count_nonzero(hit))

    async def Lookup(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if self.table is None:
            raise Unavailable(f"bundle {self.bundle} is still being verified")
        lookup = PSLookup.decode(request, self.table.keys)  # train lookups only read: nothing is ever inserted
        loop = asyncio.get_running_loop()
        out: dict[int, np.ndarray] = {}
        for dim, ids in lookup.ids.items():
            self._check_shard(ids)
            out[dim], found = await loop.run_in_executor(self.executor, self._lookup, dim, ids)
            self.counters["rows_looked_up_total"] += out[dim].shape[0]
            self.counters["rows_found_total"] += found
        self.counters["lookups_total"] += 1
        return PSRows(out).encode(self.values)

    def _refuse(self, what: str):
        self.counters["refused_total"] += 1
        return FailedPrecondition(f"read-only PS (shard {self.shard} of bundle {self.bundle}): {what} refused; "
                                  "it serves a model bundle and never changes")

    async def Update(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise self._refuse("Update")

    async def Checkpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointReply:
        raise self._refuse("Checkpoint")

    async def LoadCheckpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointReply:
        raise self._refuse("LoadCheckpoint")

    async def Publish(self, request: pb.PublishRequest, context) -> pb.PublishReply:
        raise self._refuse("Publish")

    async def Replicate(self, request: bytes, context) -> bytes:
        raise self._refuse("Replicate")

    async def PullShard(self, request: bytes, context) -> bytes:
        raise self._refuse("PullShard")

    async def Stats(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.ServiceStats:
        return pb.ServiceStats(service="embedding_ps", replica=self.shard, values=self.stats())


def _check_replica(bundle: Path, manifest: BundleManifest, replica: int) -> None:
    if replica >= manifest.num_shards:
        raise BundleError(f"{Path(bundle) / 'manifest.json'}: the bundle has {manifest.num_shards} shard(s); "
                          f"replica {replica} does not exist")


def open_shard(bundle: Path, replica: int) -> tuple[BundleManifest, ShardTable]:
    """Verify the whole bundle and map shard `replica`; BundleError naming the file when anything is off."""
    manifest = read_manifest(bundle)
    _check_replica(bundle, manifest, replica)
    verify(bundle, manifest)
    return manifest, ShardTable(Path(bundle), manifest, replica)


async def serve(settings: ReadOnlyPSSettings) -> None:
    manifest = read_manifest(settings.bundle)  # no bundle, or no such shard: fail before anything binds
    _check_replica(settings.bundle, manifest, settings.replica)
    host = ServiceHost.standalone("embedding_ps", listen=settings.listen, replica=settings.replica,
                                  metrics_port=settings.metrics_port, tls=settings.tls)
    with ThreadPoolExecutor(max_workers=settings.threads, thread_name_prefix="ps-bundle") as executor:
        servicer = ReadOnlyPSServicer(Path(settings.bundle), settings.replica,
                                      ValueCodec(fp16=settings.fp16, kappa=settings.kappa), executor)
        host.add(servicer, servicer.stats)
        await host.start()  # liveness answers while a big bundle is being verified; readiness waits
        try:
            manifest, table = await asyncio.get_running_loop().run_in_executor(
                executor, open_shard, settings.bundle, settings.replica)
        except BaseException:
            await host.server.stop(grace=None)
            raise
        servicer.attach(manifest, table)
        host.log.info("bundle_mapped", bundle=str(settings.bundle), step=manifest.step, shard=settings.replica,
                      num_shards=manifest.num_shards, rows={d: int(k.shape[0]) for d, k in table.keys.items()})
        await host.set_serving(True)
        await host.run_until_stopped()
