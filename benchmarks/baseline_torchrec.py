"""The TorchRec baseline of benchmarks/baselines.py: TorchRec on CPU as a TorchRec user sets it up.

An ``EmbeddingBagCollection`` of 26 tables on the meta device, the optimizer
applied in backward, sharded by ``DistributedModelParallel`` on one rank with
the planner restricted to table-wise sharding and the FUSED compute kernel
(FBGEMM's table-batched embedding kernel with EXACT_ADAGRAD fused into the
backward pass). It is a module of its own because it is the one part of the
baselines that needs the optional ``bench`` extra (torchrec, fbgemm-gpu-cpu;
see baselines.py's docstring for the install) and a process-group dance the
PyTorch baseline has no use for; torchrec is imported only inside the
functions, so the PyTorch baseline runs without it.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from benchmarks.baseline_data import FEATURES, Tensors, _prepare, jagged
from benchmarks.baseline_train import ADAGRAD_EPS, INIT_SCALE, BaselineResult, _check, _dnn, _train_loop
from hybridrec.core.model.models import DNN


def torchrec_available() -> tuple[bool, str]:
    """Whether torchrec (with fbgemm-gpu-cpu) imports, and why not."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
        from torchrec.distributed import DistributedModelParallel  # noqa: F401
    except Exception as exc:  # ImportError, or an OSError/RuntimeError loading the fbgemm .so
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


class TorchRecDNN(nn.Module):
    """An EmbeddingBagCollection of 26 tables + hybridrec's DNN."""

    def __init__(self, ebc: nn.Module, dnn: DNN):
        super().__init__()
        self.ebc = ebc
        self.dnn = dnn

    def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        return self.dnn(dense, self.ebc(kjt).to_dict())


def _one_rank_group():
    """A 1-rank Gloo process group for DistributedModelParallel: (group, whether we created it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("run_torchrec is a one-process baseline: call it from a process that is not "
                               f"part of a {dist.get_world_size()}-rank torch.distributed group")
        return dist.group.WORLD, False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD, True


def _destroy_group(own: bool) -> None:
    import torch.distributed as dist

    if own and dist.is_initialized():
        dist.destroy_process_group()


def _embedding_kernels(dmp: nn.Module) -> list[str]:
    """What runs the sharded tables: 'KernelClass(optimizer, location, device) xN' per kind.

    The sharded collection keeps its lookups in a plain list, so they are not submodules.
    """
    found: dict[str, int] = {}
    for mod in dmp.modules():
        for lookup in getattr(mod, "_lookups", []) or []:
            for sub in lookup.modules():
                tbe = getattr(sub, "_emb_module", None)
                if tbe is None:
                    continue
                opt = getattr(tbe, "optimizer", None)
                kind = (f"{type(tbe).__name__}(optimizer={getattr(opt, 'name', opt)}, "
                        f"tables={len(getattr(tbe, 'embedding_specs', []))}, "
                        f"{type(sub).__name__})")
                found[kind] = found.get(kind, 0) + 1
    return [f"{k} x{n}" for k, n in sorted(found.items())]


class _NoDataParallel:
    """One process: keep the MLP as it is instead of wrapping it in a 1-rank DDP."""

    def wrap(self, dmp, env, device) -> None:
        return None


def run_torchrec(train_paths, eval_paths, *, batch_size: int = 4096, epochs: int = 1,
                 max_steps: int | None = None, table_rows: int = 1_000_000, dim: int = 16,
                 hidden: Sequence[int] = (512, 256, 128), lr_emb: float = 0.05, lr_dense: float = 1e-3,
                 threads: int = 2, seed: int = 0, curve_points: int = 3,
                 emb_optimizer: str = "adagrad") -> BaselineResult:
    """TorchRec on CPU: DistributedModelParallel (1 rank), fused FBGEMM TBE, optimizer in backward.

    emb_optimizer: "adagrad" (FBGEMM EXACT_ADAGRAD: element-wise, the same update as hybridrec's PS
    and torch.optim.Adagrad) or "rowwise_adagrad" (EXACT_ROWWISE_ADAGRAD, TorchRec's usual choice).
    """
    _check(batch_size, epochs, table_rows, dim, threads)
    ok, why = torchrec_available()
    if not ok:
        raise RuntimeError(f"torchrec is not usable: {why} (pip install '.[bench]', see the module doc)")
    import torchrec
    import torchrec.optim as trec_optim
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    opt_cls = {"adagrad": torch.optim.Adagrad, "rowwise_adagrad": trec_optim.RowWiseAdagrad}.get(emb_optimizer)
    if opt_cls is None:
        raise ValueError(f"emb_optimizer must be 'adagrad' or 'rowwise_adagrad', got {emb_optimizer!r}")

    train, evals = _prepare(train_paths, eval_paths, table_rows)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, prev_threads)
        torch.manual_seed(seed)
        device = torch.device("cpu")
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=table_rows,
                                     feature_names=[f], pooling=torchrec.PoolingType.SUM,
                                     weight_init_min=-INIT_SCALE, weight_init_max=INIT_SCALE)
                  for f in FEATURES]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        # The embedding optimizer runs inside backward, fused into FBGEMM's kernel.
        apply_optimizer_in_backward(opt_cls, ebc.parameters(), {"lr": lr_emb, "eps": ADAGRAD_EPS})
        model = TorchRecDNN(ebc, _dnn(dim, hidden))

        sharders = [EmbeddingBagCollectionSharder()]
        constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                                    compute_kernels=[EmbeddingComputeKernel.FUSED.value])
                       for t in tables}
        pg, own_pg = _one_rank_group()
        stack.callback(_destroy_group, own_pg)
        env = ShardingEnv.from_process_group(pg)
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                           constraints=constraints)
        plan = planner.plan(model, sharders)
        dmp = DistributedModelParallel(model, env=env, device=device, plan=plan, sharders=sharders,
                                       data_parallel_wrapper=_NoDataParallel())
        dense_params = [p for n, p in dmp.named_parameters() if ".dnn." in f".{n}"]
        dense_opt = torch.optim.Adam(dense_params, lr=lr_dense)
        loss_fn = nn.BCEWithLogitsLoss()

        def kjt_of(d: Tensors, lo: int, hi: int) -> KeyedJaggedTensor:
            values, lengths = jagged(d.idx[lo:hi], d.present[lo:hi])
            return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)

        def step(d: Tensors, lo: int, hi: int) -> None:
            logits = dmp(d.dense[lo:hi], kjt_of(d, lo, hi))
            loss = loss_fn(logits, d.labels[lo:hi])
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()  # the embedding rows are updated here
            dense_opt.step()

        def predict(d: Tensors, lo: int, hi: int) -> torch.Tensor:
            return dmp(d.dense[lo:hi], kjt_of(d, lo, hi))

        kernels = _embedding_kernels(dmp)
        return _train_loop("torchrec", step, predict, train, evals, batch_size=batch_size, epochs=epochs,
                           max_steps=max_steps, curve_points=curve_points, threads=threads,
                           set_train=dmp.train,
                           details={"embedding": "EmbeddingBagCollection, DistributedModelParallel (1 rank), "
                                                 "table-wise, FUSED kernel",
                                    "kernels": kernels,
                                    "embedding_optimizer": f"{opt_cls.__name__} applied in backward (fused)",
                                    "dense_optimizer": "Adam", "torch": torch.__version__,
                                    "torchrec": getattr(torchrec, "__version__", "?")})
