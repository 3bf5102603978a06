"""On the NN worker: the torch.distributed process group and how the dense replica is kept in sync.

`DenseSync(model, env, training)` is the one place that decides how dense
parameters are synchronised (parallelism is applied to the user's module,
not built into it); the trainer calls forward on `DenseSync.module`:

* hybrid, sync — DistributedDataParallel: gradients AllReduced every step,
  bucketed so communication overlaps the backward pass;
* async — each replica steps on its own gradients; replicas are averaged every
  `sync_interval` steps (the throughput reference);
* shadow — ShadowSync: a background thread averages replicas continuously,
  never inside the training step (see services.nn_worker.group.shadow).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.core.config import ConfigError, Mode, TrainingConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    backend: str
    device: torch.device

    def bind_thread(self) -> None:
        """Make this rank's GPU the current device of the calling thread (CUDA's current device is per thread):
        the initializer of the compute thread, where every torch call of the NN worker runs."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)


NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"}
"""How NCCL reports a lost peer here: as an exception in the rank's own `wait()` (blocking wait, bounded by
`cluster.dense_timeout_s`), never by its watchdog tearing the process down (error handling 1, the default),
so that the trainer can abort the broken communicator and re-form the group around a replacement
(`services.nn_worker.group.membership`). `_abort_process_group` needs async error handling off."""


def resolve_backend(backend: str, rank: int, world_size: int, *, cuda_available: bool | None = None,
                    device_count: int | None = None, local_rank: int | None = None) -> DistEnv:
    """The backend (`auto`: NCCL with CUDA, else Gloo) and this rank's device; before the group forms.

    With NCCL each rank takes the GPU of its local rank (`LOCAL_RANK`, else the replica index: `hybridrec run`
    starts every rank on one host); a host with fewer GPUs than ranks is refused here, naming the setting,
    rather than NCCL refusing two ranks on one GPU later (which would look like a lost peer). The keyword
    arguments stand in for the host's CUDA facts in tests."""
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if backend == "auto":
        backend = "nccl" if cuda_available else "gloo"
    if backend != "nccl":
        return DistEnv(rank=rank, world_size=world_size, backend=backend, device=torch.device("cpu"))
    if not cuda_available:
        raise ConfigError("training.backend is nccl but CUDA is not available on this NN worker (a CPU build of "
                          "torch, or no GPU visible): use training.backend gloo or auto")
    count = torch.cuda.device_count() if device_count is None else device_count
    local = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    if not 0 <= local < count:
        raise ConfigError(f"training.backend nccl: NN worker rank {rank} is local rank {local} on this host, which "
                          f"has {count} GPU(s) visible; NCCL needs a GPU of its own for every rank (run at most "
                          f"{count} NN worker(s) per host, or set LOCAL_RANK to the index of this rank's GPU)")
    for key, value in NCCL_ENVIRONMENT.items():
        os.environ[key] = value
    return DistEnv(rank=rank, world_size=world_size, backend=backend, device=torch.device("cuda", local))


_control: "dist.ProcessGroup | None" = None
"""The Gloo group for CPU tensors beside a default group that serves none (NCCL); None: the default group
serves CPU tensors itself (Gloo). Set by `open_groups` every time the group (re)forms."""


def serves_cpu(backend: str) -> bool:
    """Whether a default group of `backend` takes CPU tensors: Gloo does; NCCL (and `cuda:...` specs) do not."""
    return backend == "gloo"


def open_groups(backend: str, store: dist.Store, *, rank: int, world_size: int, device: torch.device,
                dense_timeout: datetime.timedelta, control_timeout: datetime.timedelta) -> None:
    """Form this generation's groups (collective): the default group on `backend`, for the dense tensors (DDP's
    AllReduce, parameter broadcasts), and, when that backend serves no CPU tensors, a Gloo control group for
    the CPU ones (flags, positions, statistics, evaluation, hand-over metadata). Two groups rather than one
    mixed `cpu:gloo,cuda:nccl` group: each collective names the group that serves its tensors (`group_for`),
    so a CPU tensor can never reach NCCL, and the control group keeps the long timeout (a checkpoint's barrier
    waits for rank 0's PS dump) while the dense one bounds a training step (`cluster.dense_timeout_s`)."""
    global _control
    cpu = serves_cpu(backend)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=control_timeout if cpu else dense_timeout,
                            device_id=device if device.type == "cuda" else None)
    _control = None if cpu else dist.new_group(backend="gloo", timeout=control_timeout)


def control_group() -> "dist.ProcessGroup | None":
    """The group for CPU tensors (None: the default group, which serves them)."""
    return _control


def group_for(tensor: torch.Tensor) -> "dist.ProcessGroup | None":
    """The group that serves `tensor`'s device: the default group for GPU tensors, the control group for CPU."""
    return None if tensor.device.type != "cpu" else _control


def barrier() -> None:
    """A barrier of every rank on the control group (a CPU collective: no device synchronisation)."""
    dist.barrier(group=_control)


def close_groups() -> None:
    """Leave this generation's groups. A broken NCCL communicator is aborted (its kernels may never finish, so
    destroying it would hang); Gloo's are destroyed."""
    global _control
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    _control = None


def pin_interface(bind_host: str) -> None:
    """Gloo's pairs use the interface that holds `bind_host` (cluster.bind_host) unless it is a wildcard, so
    every socket the group listens on stays there (rank 0's store binds it itself:
    services.nn_worker.group.membership)."""
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
        if self.mode in (Mode.HYBRID, Mode.SYNC) and env.world_size > 1:  # one rank: nothing to AllReduce
            self.module: nn.Module = DistributedDataParallel(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
        else:
            self.module = model
        self.model = model
        self.synchronous = self.module is not model
        """DDP keeps the replicas equal: every rank steps on the same reduced gradients, and decides alike."""
        self.shadow = None
        if self.mode == Mode.SHADOW:
            from services.nn_worker.group.shadow import ShadowSync

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
            dist.broadcast(tensor, src=source, group=group_for(tensor))


def average_parameters(model: nn.Module, world_size: int) -> None:
    with torch.no_grad():
        flat = torch.nn.utils.parameters_to_vector(model.parameters())
        dist.all_reduce(flat, group=group_for(flat))
        flat /= world_size
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
