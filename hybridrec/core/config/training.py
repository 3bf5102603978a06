"""How the NN workers train: mode, batch, staleness, threads, compression, precision, tasks."""
from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import Field

from hybridrec.core.config.section import Section


class Mode(str, enum.Enum):
    HYBRID = "hybrid"  # async embeddings with bounded staleness, synchronous dense AllReduce
    SYNC = "sync"  # staleness 0: every lookup waits for all earlier updates; the accuracy reference
    ASYNC = "async"  # dense replicas averaged periodically, embeddings async; the throughput reference
    SHADOW = "shadow"  # dense replicas synchronised by a background thread (ShadowSync)


class CompressionConfig(Section):
    """How embeddings, gradients and IDs travel between services."""

    fp16: bool = True
    """Send embeddings and gradients as fp16 after scaling each vector by kappa/||v||
    (hybridrec/core/wire/compress.py)."""
    kappa: Annotated[float, Field(gt=0, le=60000)] = 1024.0
    """Norm each vector is scaled to before the fp16 cast."""
    lz4_ids: bool = True
    """lz4-compress the ID position buffers the data loader sends (SparseBatch). The embedding worker's replies
    to the NN workers carry them raw: decompressing cost the NN worker's event loop 0.28 ms a step (4,096
    samples of the README example) for 12% fewer bytes, and that loop bounds a GPU's throughput."""


class TrainingConfig(Section):
    """How the NN workers train."""

    mode: Mode = Mode.HYBRID
    """hybrid (default), sync, async or shadow: see `Mode`."""
    batch_size: Annotated[int, Field(gt=0, le=65535)] = 4096
    """Samples per NN-worker step (≤ 65535 so positions fit uint16)."""
    epochs: Annotated[int, Field(gt=0)] = 1
    """Passes over data.train."""
    max_steps: Annotated[int, Field(gt=0)] | None = None
    """Stop after this many steps per NN worker (None: run the epochs)."""
    staleness: Annotated[int, Field(ge=0, le=1024)] = 4
    """Most batches an NN worker may have read embeddings for without their updates applied."""
    prefetch: Annotated[int, Field(ge=1, le=1024)] = 4
    """Batches whose embedding lookups are kept in flight ahead of compute."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto is NCCL when CUDA is present, else Gloo."""
    overlap_copies: bool = True
    """NN workers on GPUs: copy each batch to the GPU from pinned memory on a side stream while the previous
    step computes, and its gradients back without making the host wait (off: synchronous copies, the
    baseline of benchmarks/gpu.py). No effect on CPUs."""
    receiver: bool = False
    """NN workers: hold the network face in a receiver process of their own — the gRPC server (each data
    loader's batch handed to the trainer as it came, which decodes and admits it as its own server would)
    and the calls to the embedding workers (each batch's lookup, checked there, and gradient push) — the
    frames handed over in shared memory, so that gRPC's work does not hold the trainer's GIL
    (services/nn_worker/receiver/process.py). Off by default: on CPUs the compute thread bounds the throughput
    either way, and it is not yet measured on a GPU."""
    capture: bool = False
    """NN workers on GPUs: run each training step as one CUDA graph over static buffers, the batch padded to a
    few bucketed shapes (services/nn_worker/captured.py); a step that cannot be captured runs eagerly, with one
    warning naming why. No effect on CPUs. Off by default until measured on a GPU."""
    torch_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """Intra-op threads per NN worker. `auto`: sized by `hybridrec run` from the host's cores (1 where the
    rank has a GPU; on CPUs, about half the host shared by the ranks), or by an NN worker started alone from
    the cores it may run on (hybridrec/app/plan/layout.py)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Dense forward/backward in fp32, or under bf16 autocast (GPUs, and CPUs with AVX512-BF16 or AMX:
    about 2x faster matmuls). Parameters, optimizer state, embeddings and the loss stay fp32."""
    sync_interval: Annotated[int, Field(ge=1)] = 16
    """async mode: average dense replicas every this many steps."""
    shadow_algorithm: Literal["easgd", "ma", "bmuf"] = "ma"
    """shadow mode: how the background thread merges replicas (elastic averaging, model averaging, BMUF)."""
    shadow_alpha: Annotated[float, Field(gt=0, le=1)] = 0.5
    """ShadowSync elastic parameter."""
    shadow_interval_s: Annotated[float, Field(gt=0)] = 0.2
    """shadow mode: seconds between two background synchronisations."""
    eval_batch_size: Annotated[int, Field(gt=0, le=65535)] = 8192
    """Samples per evaluation batch (≤ 65535 so positions fit uint16)."""
    seed: int = 0
    """Seed of the dense model's initialisation and of the PS's row initialisation and admission draws."""
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    """Wire format of embeddings, gradients and IDs."""
    progressive_window: Annotated[int, Field(gt=0)] = 100_000
    """Samples in the sliding window of progressive validation: each training sample predicted before the
    step that trains on it (the progress line's AUC, and the summary's `progressive_auc`; the online metric)."""
    log_every_s: Annotated[float, Field(gt=0)] = 5.0
    """Seconds between two progress log lines of an NN worker."""
    task_weights: list[Annotated[float, Field(ge=0)]] | None = None
    """Multi-task: the weight of each task's loss in the training loss, one per `data.labels` entry
    (None: 1 each)."""
    loss: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")] | None = None
    """`module:function`: the training loss is `function(logits, labels, weights)` instead of the built-in
    one (each task's own loss, weighted by `task_weights`). logits (the model's raw outputs: a regression
    task's offset and scale are not applied) and labels are float32 (batch,) tensors with one task,
    (batch, tasks) with several; weights is the (batch,) sample weights (`data.weight_column`; ones
    without one). It must return a finite scalar tensor, differentiable in logits: the summary's losses are its
    values. The module is imported by the NN workers (and by `hybridrec check`), so it must be importable
    there (installed, or on PYTHONPATH)."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A training step whose loss or gradients are not finite (NaN or inf: a model can make one from finite
    input) updates nothing, on every rank alike: not the dense model, not its optimizer's state, not a PS row.
    `skip`: the step is counted (`nonfinite_steps` in the summary and the metrics) and training goes on;
    `stop`: the run stops, naming the step and the rank, before any checkpoint could hold it."""
