"""`hybridrec serve embedding_worker`: the gRPC face of services.embedding_worker.worker."""
from __future__ import annotations

import grpc
import numpy as np

from hybridrec.core.runtime import rpc
from hybridrec.core.runtime.lazy_torch import import_torch_in_background, imported
from hybridrec.core.config import Config
from hybridrec.core.wire.dedup import has_duplicates, unique_inverse
from hybridrec.core.wire.frames import Applied, BatchRef, Gradients
from hybridrec.core.wire.proto import pb
from hybridrec.core.runtime.rpc import Unavailable
from hybridrec.core.runtime.service import ServiceHost, at_work
from services.embedding_worker.aggregation import scatter_add_rows
from services.embedding_worker.worker import EmbeddingWorker


class EmbeddingWorkerServicer:
    def __init__(self, worker: EmbeddingWorker):
        self.worker = worker

    async def PutBatch(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return BatchRef(self.worker.put(request)).encode()

    async def Lookup(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        rows = await self.worker.lookup(BatchRef.decode(request).batch_ref)
        at_work("batch delivered")
        return rows

    async def PushGradients(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        ref, discard = Gradients.peek(request)
        if self.worker.already_applied(ref):
            return Applied(0).encode()
        if discard:  # the step was not finite: the batch goes, no PS row is touched
            return self.worker.discard(ref).encode()
        gradients = Gradients.decode(request, self.worker.values, self.worker.rows_of)
        return (await self.worker.push_gradients(gradients)).encode()

    async def Stats(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.ServiceStats:
        return pb.ServiceStats(service="embedding_worker", replica=self.worker.replica, values=self.worker.stats(),
                               recovery=self.worker.recovery())


def warm_up() -> None:
    """Compile (or load from numba's cache) the embedding worker's kernels now, not inside the first batch's
    deadline: deduplication and gradient aggregation (the fork server calls it once for every worker)."""
    ids = np.array([3, 1, 3], np.uint64)
    if has_duplicates(ids):
        unique_inverse(ids)
    scatter_add_rows(np.zeros((1, 1), np.float32), np.zeros(1, np.int32), np.zeros((1, 1), np.float32))


async def serve(config: Config, replica: int) -> None:
    host = ServiceHost("embedding_worker", config, replica)
    torch_import = None
    if config.training.compression.fp16:  # only the fp16 value codec uses torch here; one thread beats contention
        torch_import = import_torch_in_background(threads=1)
    channels = [rpc.channel(address) for address in config.cluster.ps]
    methods = {(s, m): rpc.raw_method(ch, "EmbeddingPS", m) for s, ch in enumerate(channels)
               for m in ("Lookup", "Update")}
    timeout = config.cluster.rpc_timeout_s

    async def ps_call(shard: int, method: str, frame: bytes) -> bytes:
        try:
            return await rpc.retry(lambda: methods[(shard, method)](frame, timeout=timeout),
                                   deadline_s=config.cluster.retry_s)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"PS shard {shard} ({config.cluster.ps[shard]}) {method} failed: "
                              f"{exc.code().name} {exc.details()}") from exc

    warm_up()
    # Before the server starts: a batch of a previous life is served the moment requests arrive.
    worker = EmbeddingWorker(config, replica, ps_call)
    host.log.info("buffer_open", directory=str(worker.files.directory), incarnation=worker.incarnation,
                  batches=len(worker.buffer))
    host.add(EmbeddingWorkerServicer(worker), worker.stats)
    try:
        await host.start()
        await rpc.wait_until_serving(config.cluster.ps, timeout_s=config.cluster.start_timeout_s,
                                     what="PS shards")
        await imported(torch_import)
        await host.set_serving(True)
        await host.run_until_stopped()
        unapplied = [ref for ref, batch in worker.buffer.items() if batch.looked_up]
        if unapplied:  # the run's lost_updates: which batches, for an audit against the NN workers' logs
            host.log.warning("unapplied_train_batches", count=len(unapplied), batch_refs=unapplied[:64])
    finally:
        for ch in channels:
            await ch.close()
        worker.close()
