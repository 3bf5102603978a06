"""On the NN worker: the torch.distributed process group and how the dense replica is kept in sync.

`DenseSync(model, env, training)` is the one place that decides how dense
parameters are synchronised (parallelism is applied to the user's module,
not built into it); the trainer calls forward on `DenseSync.module`:

* hybrid, sync — DistributedDataParallel: gradients AllReduced every step,
  bucketed so communication overlaps the backward pass;
* async — each replica steps on its own gradients; replicas are averaged every
  `sync_interval` steps (the throughput reference);
* shadow — ShadowSync: a background thread averages replicas continuously,
  never inside the training step (see services.nn_worker.shadow).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.config import Mode, TrainingConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    backend: str
    device: torch.device


def resolve_backend(backend: str, rank: int, world_size: int) -> DistEnv:
    """The backend (`auto`: NCCL with CUDA, else Gloo) and this rank's device; before the group forms."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("training.backend is nccl but CUDA is not available on this NN worker")
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistEnv(rank=rank, world_size=world_size, backend=backend, device=device)


def pin_interface(bind_host: str) -> None:
    """Gloo's pairs use the interface that holds `bind_host` (cluster.bind_host) unless it is a wildcard, so
    every socket the group listens on stays there (rank 0's store binds it itself: services.nn_worker.membership)."""
    interface = interface_of(bind_host)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)


def interface_of(bind_host: str) -> str | None:
    """The network interface that holds address `bind_host`; None for a wildcard or a name we cannot match."""
    if bind_host in ("", "0.0.0.0", "::"):
        return None
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == bind_host for a in addresses):
            return name
    return None


class DenseSync:
    """Keeps dense replicas consistent; `module` is what the trainer calls forward on."""

    def __init__(self, model: nn.Module, env: DistEnv, training: TrainingConfig, source: int = 0):
        self.env, self.training = env, training
        self.mode = training.mode
        broadcast_parameters(model, source)
        if self.mode in (Mode.HYBRID, Mode.SYNC):
            self.module: nn.Module = DistributedDataParallel(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
        else:
            self.module = model
        self.model = model
        self.shadow = None
        if self.mode == Mode.SHADOW:
            from services.nn_worker.shadow import ShadowSync

            self.shadow = ShadowSync(model, env, algorithm=training.shadow_algorithm, alpha=training.shadow_alpha,
                                     interval_s=training.shadow_interval_s)

    def after_step(self, step: int) -> None:
        """Called on the compute thread after each optimizer step."""
        if self.mode == Mode.ASYNC and self.env.world_size > 1 and step % self.training.sync_interval == 0:
            average_parameters(self.model, self.env.world_size)

    def finish(self) -> None:
        """Leave the replicas identical before evaluation."""
        if self.shadow is not None:
            self.shadow.stop()
        if self.mode in (Mode.ASYNC, Mode.SHADOW) and self.env.world_size > 1:
            average_parameters(self.model, self.env.world_size)


def broadcast_parameters(model: nn.Module, source: int = 0) -> None:
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=source)


def average_parameters(model: nn.Module, world_size: int, group=None) -> None:
    with torch.no_grad():
        flat = torch.nn.utils.parameters_to_vector(model.parameters())
        dist.all_reduce(flat, group=group)
        flat /= world_size
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
