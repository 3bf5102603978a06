"""Baselines a user would pick instead of hybridrec on one machine (docs/benchmarks.md).

Both train the model hybridrec trains by default -- one sum-pooled embedding bag
of ``table_rows`` x ``dim`` per Criteo categorical feature (C1..C26, hashing
trick: row = id % table_rows; a missing value is an empty bag), concatenated
after the 13 dense features and fed to ``hybridrec.core.model.models.DNN`` (the very same
module, hidden 512-256-128), BCE-with-logits mean loss -- on the same data
(read with hybridrec's own ``read_criteo``), with Adagrad on the embeddings
(element-wise, eps 1e-10, rows initialised uniform(-0.01, 0.01), as the PS
does by default) and Adam on the MLP:

* ``run_pytorch``: single-process PyTorch: 26 ``nn.EmbeddingBag(sparse=True)``,
  ``torch.optim.Adagrad`` on their sparse gradients, ``torch.optim.Adam`` on the
  MLP. The same function runs it on a GPU (``device="cuda"``, all the data
  indexed on the GPU): benchmarks/gpu.py's ``pytorch_gpu`` baseline.
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
import json
import os
import sys
import time
from pathlib import Path
from typing import ContextManager, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The data side, the shared training loop and the TorchRec baseline live in their own modules
# (baseline_data, baseline_train, baseline_torchrec) to keep each one short; this one keeps the
# PyTorch baseline and the command line, and re-exports the rest so `benchmarks.baselines` (or
# this file loaded by path) still offers every name it did.
from benchmarks.baseline_data import (  # noqa: E402,F401
    FEATURES, READ_CHUNK_ROWS, Arrays, Tensors, _prepare, clear_cache, jagged, load, to_tensors)
from benchmarks.baseline_torchrec import TorchRecDNN, run_torchrec, torchrec_available  # noqa: E402,F401
from benchmarks.baseline_train import (  # noqa: E402,F401
    ADAGRAD_EPS, EVAL_BATCH, INIT_SCALE, BaselineResult, _check, _dnn, _train_loop, no_sync)


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
        if dense.is_cuda:
            return self.dnn(dense, self._pooled_on_device(idx, present))
        b = dense.shape[0]
        values, lengths = jagged(idx, present)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        bounds = offsets[::b].tolist()  # where each feature's values start (one sync, not 26)
        pooled = {}
        for f, (name, table) in enumerate(zip(FEATURES, self.tables)):
            lo = bounds[f]
            pooled[name] = table(values[lo:bounds[f + 1]], offsets[f * b:(f + 1) * b] - lo)
        return self.dnn(dense, pooled)

    def _pooled_on_device(self, idx: torch.Tensor, present: torch.Tensor) -> dict[str, torch.Tensor]:
        """The same sums without a host synchronisation (a GPU must not wait on the host every step): each
        sample's ID in a bag of one, weighted 1 when present and 0 when absent, in place of the jagged values
        and their offsets (which need the present count on the host)."""
        weights = present.to(torch.float32)
        return {name: table(idx[:, f:f + 1], per_sample_weights=weights[:, f:f + 1])
                for f, (name, table) in enumerate(zip(FEATURES, self.tables))}


def run_pytorch(train_paths, eval_paths, *, batch_size: int = 4096, epochs: int = 1,
                max_steps: int | None = None, table_rows: int = 1_000_000, dim: int = 16,
                hidden: Sequence[int] = (512, 256, 128), lr_emb: float = 0.05, lr_dense: float = 1e-3,
                threads: int = 2, seed: int = 0, curve_points: int = 3, device: str | torch.device = "cpu",
                watch: ContextManager | None = None) -> BaselineResult:
    """Single-process PyTorch: sparse EmbeddingBags + Adagrad, the DNN + Adam.

    One function for the CPU baseline and the GPU one (benchmarks/gpu.py), so the two differ only in `device`:
    the model is built (and initialised, from `seed`) on the CPU and moved there, all the data is indexed on it
    before the clock starts, and the clock waits for the device. `watch` is entered around the training loop
    (benchmarks/gpu.py samples the GPU's utilisation in it)."""
    _check(batch_size, epochs, table_rows, dim, threads)
    dev = torch.device(device)
    train, evals = (t.to(dev) for t in _prepare(train_paths, eval_paths, table_rows))
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else no_sync
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = EmbeddingBagDNN(table_rows, dim, hidden).to(dev)
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
                               set_train=model.train, sync=sync, watch=watch,
                               details={"embedding": "26 x nn.EmbeddingBag(sum, sparse=True)",
                                        "embedding_optimizer": "torch.optim.Adagrad", "dense_optimizer": "Adam",
                                        "torch": torch.__version__, "device": str(dev)})
    finally:
        torch.set_num_threads(prev_threads)


# ------------------------------------------------------------------ CLI

RUNNERS = {"pytorch": run_pytorch, "torchrec": run_torchrec}


def _data_paths(data: Path, prepared: Path | None = None) -> tuple[list[str], list[str]]:
    train, evals = (prepared / "train", prepared / "eval") if prepared else (data / "train.tsv", data / "eval.tsv")
    for p in (train, evals):
        if not p.exists():
            raise SystemExit(f"{p} is missing (make it with: hybridrec data synth --out {data} --rows 1000000)")
    return [str(train)], [str(evals)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="directory with train.tsv and eval.tsv")
    ap.add_argument("--prepared", type=Path, default=None, help="read train/ and eval/ of this directory, "
                    "prepared from --data's files by `hybridrec data prepare`, instead of the TSV files")
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

    train, evals = _data_paths(args.data, args.prepared)
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
