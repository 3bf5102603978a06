"""Baselines a user would pick instead of hybridrec on one machine (issue 5).

Both train the model hybridrec trains by default -- one sum-pooled embedding bag
of ``table_rows`` x ``dim`` per Criteo categorical feature (C1..C26, hashing
trick: row = id % table_rows; a missing value is an empty bag), concatenated
after the 13 dense features and fed to ``hybridrec.models.DNN`` (the very same
module, hidden 512-256-128), BCE-with-logits mean loss -- on the same data
(read with hybridrec's own ``read_criteo``), with Adagrad on the embeddings
(element-wise, eps 1e-10, rows initialised uniform(-0.01, 0.01), as the PS
does by default) and Adam on the MLP:

* ``run_pytorch``: single-process PyTorch: 26 ``nn.EmbeddingBag(sparse=True)``,
  ``torch.optim.Adagrad`` on their sparse gradients, ``torch.optim.Adam`` on the
  MLP.
* ``run_torchrec``: TorchRec on CPU as a TorchRec user sets it up: an
  ``EmbeddingBagCollection`` of 26 tables on the meta device, the optimizer
  applied in backward (``apply_optimizer_in_backward``), sharded by
  ``DistributedModelParallel`` on one rank with the planner restricted to
  table-wise sharding and the FUSED compute kernel, i.e. FBGEMM's
  table-batched embedding kernel (``SplitTableBatchedEmbeddingBagsCodegen``,
  ``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``) with EXACT_ADAGRAD (or
  EXACT_ROWWISE_ADAGRAD) fused into the backward pass: no dense gradient over
  a table is ever formed. Batches go in as one ``KeyedJaggedTensor`` built
  with a few vectorised tensor ops.

All data is loaded into memory (and indexed) before the clock starts; the
reported samples/s is train samples / train wall time (evaluations for the
AUC-vs-time curve are excluded from it), as in hybridrec's own figure.

    python benchmarks/baselines.py --data data/synth --which both --out results/baselines.json

TorchRec needs ``pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0`` and
``pip install tensordict torchmetrics==1.0.3 pyre-extensions iopath tqdm``
(the ``bench`` extra); the 1.9 pair does not load with torch 2.13.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrec.models import DNN, FeatureInfo  # noqa: E402
from services.dataloader.criteo import NUM_DENSE, NUM_SPARSE, read_criteo  # noqa: E402

FEATURES = [f"C{i + 1}" for i in range(NUM_SPARSE)]
INIT_SCALE = 0.01  # hybridrec's default ps.init: uniform(-0.01, 0.01)
ADAGRAD_EPS = 1e-10  # hybridrec's default optimizer.embedding.eps
EVAL_BATCH = 65536
READ_CHUNK_ROWS = 1 << 18


@dataclass
class BaselineResult:
    name: str
    samples_per_sec: float
    auc: float
    logloss: float
    train_wall_s: float
    samples: int
    curve: list[tuple[float, float]] = field(default_factory=list)
    """(train wall seconds, eval AUC) after some steps; the last point is the final model."""
    steps: int = 0
    threads: int = 1
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["curve"] = [list(p) for p in self.curve]
        return d


# ------------------------------------------------------------------ data

@dataclass
class Arrays:
    """A Criteo file (or several) in memory, as read_criteo gives it."""

    labels: np.ndarray  # float32 (n,)
    dense: np.ndarray  # float32 (n, 13), log1p
    ids: np.ndarray  # uint64 (n, 26), group in the top 8 bits
    present: np.ndarray  # bool (n, 26)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


_CACHE: dict[tuple, Arrays] = {}


def _key(paths: Sequence[str | os.PathLike]) -> tuple:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((os.path.abspath(p), st.st_size, st.st_mtime_ns))
    return tuple(out)


def load(paths: str | os.PathLike | Sequence[str | os.PathLike], *, cache: bool = True) -> Arrays:
    """Read Criteo files with hybridrec's reader into one set of arrays.

    Kept in a small per-process cache (keyed by path, size and mtime) so that a
    driver running several baselines over the same files reads them once.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    key = _key(paths)
    if cache and key in _CACHE:
        return _CACHE[key]
    chunks = [c for p in paths for c in read_criteo(p, chunk_rows=READ_CHUNK_ROWS)]
    if not chunks or sum(len(c) for c in chunks) == 0:
        raise ValueError(f"no samples in {list(map(str, paths))}")
    arrays = Arrays(*(np.concatenate([getattr(c, k) for c in chunks])
                      for k in ("labels", "dense", "ids", "present")))
    if cache:
        if len(_CACHE) >= 4:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = arrays
    return arrays


def clear_cache() -> None:
    _CACHE.clear()


@dataclass
class Tensors:
    """Model-ready tensors: row indices already hashed into the tables."""

    labels: torch.Tensor  # float32 (n,)
    dense: torch.Tensor  # float32 (n, 13)
    idx: torch.Tensor  # int64 (n, 26): id % table_rows
    present: torch.Tensor  # bool (n, 26)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def to_tensors(a: Arrays, table_rows: int) -> Tensors:
    idx = (a.ids % np.uint64(table_rows)).astype(np.int64)
    return Tensors(torch.from_numpy(a.labels), torch.from_numpy(a.dense), torch.from_numpy(idx),
                   torch.from_numpy(a.present))


def jagged(idx: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of a batch in feature-major (KeyedJaggedTensor) order.

    values: the present row indices of feature 0 for every sample, then feature 1, ...;
    lengths: int64 (26 * B,), lengths[f * B + b] = 1 if feature f of sample b is present else 0.
    """
    pt = present.t()
    return idx.t()[pt], pt.reshape(-1).to(torch.int64)


# ------------------------------------------------------------------ metrics

def _metrics(labels: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    from sklearn.metrics import log_loss, roc_auc_score

    p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(roc_auc_score(labels, logits)), float(log_loss(labels, p, labels=[0, 1]))


@torch.no_grad()
def _evaluate(predict: Callable[[Tensors, int, int], torch.Tensor], data: Tensors) -> tuple[float, float]:
    out = [predict(data, lo, min(lo + EVAL_BATCH, len(data))).float().numpy()
           for lo in range(0, len(data), EVAL_BATCH)]
    return _metrics(data.labels.numpy(), np.concatenate(out))


def _curve_steps(total_steps: int, points: int) -> set[int]:
    """Steps (1-based, < total) after which to evaluate for the AUC-vs-time curve."""
    if points <= 0 or total_steps < 2:
        return set()
    return {max(1, round(total_steps * k / (points + 1))) for k in range(1, points + 1)} - {total_steps}


def _train_loop(name: str, step_fn: Callable[[Tensors, int, int], None],
                predict: Callable[[Tensors, int, int], torch.Tensor], train: Tensors, evals: Tensors, *,
                batch_size: int, epochs: int, max_steps: int | None, curve_points: int, threads: int,
                set_train: Callable[[bool], None], details: dict) -> BaselineResult:
    n = len(train)
    steps_per_epoch = math.ceil(n / batch_size)
    total = steps_per_epoch * epochs if max_steps is None else min(max_steps, steps_per_epoch * epochs)
    evals_at = _curve_steps(total, curve_points)
    curve: list[tuple[float, float]] = []
    wall = cpu = 0.0
    samples = 0
    step = 0
    load_before = os.getloadavg()[0]
    set_train(True)
    t0, c0 = time.perf_counter(), time.process_time()
    while step < total:
        lo = (step % steps_per_epoch) * batch_size
        hi = min(lo + batch_size, n)
        step_fn(train, lo, hi)
        samples += hi - lo
        step += 1
        if step in evals_at:
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            set_train(False)
            curve.append((wall, _evaluate(predict, evals)[0]))
            set_train(True)
            t0, c0 = time.perf_counter(), time.process_time()
    wall += time.perf_counter() - t0
    cpu += time.process_time() - c0
    # CPU seconds the process got while training: on a shared machine, wall time / CPU time shows
    # how much of the cores it actually had (2 threads on 2 free cores: cpu close to 2 x wall).
    details = {**details, "train_cpu_s": cpu, "loadavg_1m_before": load_before,
               "loadavg_1m_after": os.getloadavg()[0]}
    set_train(False)
    auc, logloss = _evaluate(predict, evals)
    curve.append((wall, auc))
    return BaselineResult(name=name, samples_per_sec=samples / wall if wall > 0 else 0.0, auc=auc,
                          logloss=logloss, train_wall_s=wall, samples=samples, curve=curve, steps=step,
                          threads=threads, details=details)


def _prepare(train_paths, eval_paths, table_rows: int) -> tuple[Tensors, Tensors]:
    return to_tensors(load(train_paths), table_rows), to_tensors(load(eval_paths), table_rows)


def _dnn(dim: int, hidden: Sequence[int]) -> DNN:
    return DNN(features=[FeatureInfo(f, dim) for f in FEATURES], num_dense=NUM_DENSE, hidden=list(hidden))


def _check(batch_size: int, epochs: int, table_rows: int, dim: int, threads: int) -> None:
    if batch_size <= 0 or epochs <= 0 or table_rows <= 0 or dim <= 0 or threads <= 0:
        raise ValueError("batch_size, epochs, table_rows, dim and threads must be positive")


# ------------------------------------------------------------------ (a) single-process PyTorch

class EmbeddingBagDNN(nn.Module):
    """26 sparse nn.EmbeddingBag tables + hybridrec's DNN."""

    def __init__(self, table_rows: int, dim: int, hidden: Sequence[int]):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(table_rows, dim, mode="sum", sparse=True)
                                    for _ in FEATURES)
        for t in self.tables:
            nn.init.uniform_(t.weight, -INIT_SCALE, INIT_SCALE)
        self.dnn = _dnn(dim, hidden)

    def forward(self, dense: torch.Tensor, idx: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        b = dense.shape[0]
        values, lengths = jagged(idx, present)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        bounds = offsets[::b].tolist()  # where each feature's values start (one sync, not 26)
        pooled = {}
        for f, (name, table) in enumerate(zip(FEATURES, self.tables)):
            lo = bounds[f]
            pooled[name] = table(values[lo:bounds[f + 1]], offsets[f * b:(f + 1) * b] - lo)
        return self.dnn(dense, pooled)


def run_pytorch(train_paths, eval_paths, *, batch_size: int = 4096, epochs: int = 1,
                max_steps: int | None = None, table_rows: int = 1_000_000, dim: int = 16,
                hidden: Sequence[int] = (512, 256, 128), lr_emb: float = 0.05, lr_dense: float = 1e-3,
                threads: int = 2, seed: int = 0, curve_points: int = 3) -> BaselineResult:
    """Single-process PyTorch: sparse EmbeddingBags + Adagrad, the DNN + Adam."""
    _check(batch_size, epochs, table_rows, dim, threads)
    train, evals = _prepare(train_paths, eval_paths, table_rows)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = EmbeddingBagDNN(table_rows, dim, hidden)
        emb_opt = torch.optim.Adagrad(model.tables.parameters(), lr=lr_emb, eps=ADAGRAD_EPS)
        dense_opt = torch.optim.Adam(model.dnn.parameters(), lr=lr_dense)
        loss_fn = nn.BCEWithLogitsLoss()

        def step(d: Tensors, lo: int, hi: int) -> None:
            logits = model(d.dense[lo:hi], d.idx[lo:hi], d.present[lo:hi])
            loss = loss_fn(logits, d.labels[lo:hi])
            emb_opt.zero_grad(set_to_none=True)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            emb_opt.step()
            dense_opt.step()

        def predict(d: Tensors, lo: int, hi: int) -> torch.Tensor:
            return model(d.dense[lo:hi], d.idx[lo:hi], d.present[lo:hi])

        # Opt out of sparse invariant checks explicitly (Adagrad's sparse_coo_tensor warns otherwise).
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            return _train_loop("pytorch", step, predict, train, evals, batch_size=batch_size, epochs=epochs,
                               max_steps=max_steps, curve_points=curve_points, threads=threads,
                               set_train=model.train,
                               details={"embedding": "26 x nn.EmbeddingBag(sum, sparse=True)",
                                        "embedding_optimizer": "torch.optim.Adagrad", "dense_optimizer": "Adam",
                                        "torch": torch.__version__})
    finally:
        torch.set_num_threads(prev_threads)


# ------------------------------------------------------------------ (b) TorchRec on CPU

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


# ------------------------------------------------------------------ CLI

RUNNERS = {"pytorch": run_pytorch, "torchrec": run_torchrec}


def _data_paths(data: Path) -> tuple[list[str], list[str]]:
    train, evals = data / "train.tsv", data / "eval.tsv"
    for p in (train, evals):
        if not p.exists():
            raise SystemExit(f"{p} is missing (make it with: hybridrec data synth --out {data} --rows 1000000)")
    return [str(train)], [str(evals)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory with train.tsv and eval.tsv")
    ap.add_argument("--which", choices=["pytorch", "torchrec", "both"], default="both")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--table-rows", type=int, default=1_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--curve-points", type=int, default=3, help="evaluations during training (for the curve)")
    ap.add_argument("--emb-optimizer", choices=["adagrad", "rowwise_adagrad"], default="adagrad",
                    help="TorchRec's fused embedding optimizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    train, evals = _data_paths(args.data)
    t = time.perf_counter()
    load(train), load(evals)
    print(f"loaded {len(load(train))} train / {len(load(evals))} eval rows in {time.perf_counter() - t:.1f} s",
          flush=True)
    which = ["pytorch", "torchrec"] if args.which == "both" else [args.which]
    out = {"baselines": {}, "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "load_before": os.getloadavg()}
    for name in which:
        kwargs = dict(batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps,
                      table_rows=args.table_rows, threads=args.threads, seed=args.seed,
                      curve_points=args.curve_points)
        if name == "torchrec":
            kwargs["emb_optimizer"] = args.emb_optimizer
        res = RUNNERS[name](train, evals, **kwargs)
        out["baselines"][name] = res.to_json()
        out["baselines"][name]["loadavg_after"] = os.getloadavg()
        print(f"{name}: {res.samples_per_sec:,.0f} samples/s, AUC {res.auc:.4f}, logloss {res.logloss:.4f}, "
              f"{res.samples} samples in {res.train_wall_s:.1f} s (load avg {os.getloadavg()[0]:.2f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
