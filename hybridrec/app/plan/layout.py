"""`hybridrec run`'s local layout fitted to the host: how many data loaders, embedding workers, PS shards and
NN workers, and how many intra-op threads per NN worker, from the cores and GPUs this process may use.

A config asks for it per key with `auto` (`cluster.dataloader`, `cluster.embedding_workers`, `cluster.ps`,
`cluster.nn_workers`, `training.torch_threads`); listed addresses and numbers are kept as they are. The
rules, in order:

* **NN workers**: one per GPU where the backend takes GPUs (`nccl`, or `auto` with GPUs), else one.
* **Cores for the dense side**: a rank with a GPU needs two (its event loop and its compute thread); a rank
  on the CPU its compute thread's intra-op threads plus one. `torch_threads: auto` gives a GPU rank one
  thread and the CPU ranks together about half the host.
* **The rest** go to the sparse side, split as it costs (data loaders no more than the training data can be
  split into, and one for a stream): per 1M training samples of the README example the
  PS shards took 0.42 of the sparse side's CPU, the embedding workers 0.31 and the data loader 0.27
  (docs/benchmarks.md, "Where the CPU goes"). At least 2 PS shards, 1 embedding worker and 1 data loader:
  on the 2-vCPU development machine the README example's own layout.

What cannot fit is refused naming the key (more NN workers than GPUs under NCCL) or adjusted with a warning
(more intra-op threads than cores), never left to hang.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from hybridrec.core.config import AUTO, Config, ConfigError, from_dict

SPARSE_SHARES = {"ps": 0.42, "embedding_workers": 0.31, "dataloader": 0.27}
"""Each sparse-side service's share of the sparse side's CPU per training sample (README example)."""
MINIMUM = {"ps": 2, "embedding_workers": 1, "dataloader": 1}
MAX_EMBEDDING_WORKERS = 255


@dataclass(frozen=True)
class Host:
    cores: int
    gpus: int

    @classmethod
    def here(cls) -> "Host":
        """The cores this process may run on and the GPUs it sees (device files, narrowed by
        CUDA_VISIBLE_DEVICES): no torch import in the launcher."""
        return cls(len(os.sched_getaffinity(0)), visible_gpus())


def visible_gpus() -> int:
    devices = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not devices:
        return devices
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and ids[0] in ("-1", ""):
        return 0
    return min(devices, len(ids))


@dataclass(frozen=True)
class Layout:
    dataloader: int
    embedding_workers: int
    ps: int
    nn_workers: int
    torch_threads: int
    host: Host
    fitted: tuple[str, ...]
    """The keys this layout chose (they were `auto`); the rest are the config's."""
    notes: tuple[str, ...] = ()

    def line(self) -> str:
        chosen = f"fitted: {', '.join(self.fitted)}" if self.fitted else "as configured"
        return (f"{self.ps} PS shards, {self.embedding_workers} embedding worker(s), {self.dataloader} data "
                f"loader(s), {self.nn_workers} NN worker(s) with {self.torch_threads} torch thread(s) each, on "
                f"{self.host.cores} cores and {self.host.gpus} GPU(s) ({chosen})")


def fit(config: Config, host: Host, *, max_loaders: int | None = None) -> tuple[Config, Layout]:
    """`config` with every `auto` replica list and thread count sized to `host`, and what was chosen; an `auto`
    loader count stays within `max_loaders` (what the data can be split into: `hybridrec run` finds it) and
    is 1 for a stream (its partitions are the published stream's, `hybridrec data replay --partitions`)."""
    cluster, training = config.cluster, config.training
    auto = set(cluster.sized_by_host())
    fitted: list[str] = []
    notes: list[str] = []
    gpus_used = training.backend == "nccl" or (training.backend == "auto" and host.gpus > 0)
    if training.backend == "nccl" and host.gpus == 0:
        raise ConfigError("training.backend is nccl but this host has no GPU visible: use training.backend gloo "
                          "or auto")
    nn = len(cluster.nn_workers)
    if "nn_workers" in auto:
        nn = host.gpus if gpus_used else 1
        fitted.append(f"cluster.nn_workers={nn}")
    elif gpus_used and nn > host.gpus:
        raise ConfigError(f"cluster.nn_workers: {nn} NN workers on NCCL need a GPU each; this host has "
                          f"{host.gpus} visible (list at most {host.gpus}, or use cluster.nn_workers: auto)")
    threads = training.torch_threads
    if threads == AUTO:
        threads = 1 if gpus_used else max(1, host.cores // 2 // nn - 1)
        fitted.append(f"training.torch_threads={threads}")
    elif not gpus_used and nn * (threads + 1) > host.cores and threads > 1:
        fair = max(1, host.cores // nn - 1)
        notes.append(f"training.torch_threads {threads} x {nn} NN workers is more than this host's {host.cores} "
                     f"cores: {fair} per NN worker instead")
        threads = fair
    dense_cores = nn * 2 if gpus_used else nn * (threads + 1)
    spare = max(0, host.cores - dense_cores)
    counts = {key: len(getattr(cluster, key)) for key in SPARSE_SHARES}
    for key, share in SPARSE_SHARES.items():
        if key in auto:
            counts[key] = max(MINIMUM[key], int(spare * share))
    if config.data.stream is not None:
        max_loaders = 1
    if max_loaders is not None and "dataloader" in auto:
        counts["dataloader"] = min(counts["dataloader"], max(1, max_loaders))
    counts["embedding_workers"] = min(counts["embedding_workers"], MAX_EMBEDDING_WORKERS)
    fitted += [f"cluster.{key}={counts[key]}" for key in SPARSE_SHARES if key in auto]
    tree = config.model_dump(mode="json")
    for key in (*SPARSE_SHARES, "nn_workers"):
        if key in auto:
            tree["cluster"][key] = ["127.0.0.1:0"] * (nn if key == "nn_workers" else counts[key])
    tree["training"]["torch_threads"] = threads
    layout = Layout(counts["dataloader"], counts["embedding_workers"], counts["ps"], nn, threads, host,
                    tuple(fitted), tuple(notes))
    return from_dict(tree, source="config fitted to the host"), layout
