"""On the NN worker's compute thread: the math of a step, apart from the pipeline that feeds it.

`StepMath` owns the dense model, its optimizer and its synchronisation (`DenseSync`), and does what touches
them: a training step (forward, loss, backward, optimizer, the embedding gradients packed for the PS and their
copy to the host), an evaluation batch's predictions, and a replayed batch's embedding gradients under a frozen
model. It knows nothing of streams, staleness, checkpoints or the event loop: the trainer (trainer.py) runs it
on its compute thread and keeps the books around it, and a test runs it with a model, a batch and its
embeddings.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridrec.core.config import Config, TrainingConfig
from hybridrec.core.wire.frames import DenseBatch, Gradients
from hybridrec.core.model.pooling import BatchEmbeddings, Pooler
from hybridrec.core.model.tasks import Tasks
from services.nn_worker.group.distributed import DenseSync, DistEnv, group_for
from services.nn_worker.feed import DeviceFeed
from services.nn_worker.lr_decay import LrDecay


@dataclass(frozen=True)
class StepOutput:
    """A training step's loss and embedding gradients on the host, valid once `event` has completed (None: at
    once; on a GPU the copy is still under way when the compute thread returns)."""

    host: dict  # "loss" -> 0-d tensor, "logits" -> (B,) or (B, tasks), and the gradients' packed tensors
    event: "torch.cuda.Event | None"
    grad_keys: tuple[str, ...] = ()  # which of `host` are the `Gradients` frame's tensors
    out: Any = None  # the receiver's slot for the gradient frame (`Trainer.outgoing`), or None
    written: int | None = None  # the frame's length once written there (on the CPU: by the step itself)

    def loss(self) -> float:
        return float(self.host["loss"])

    @property
    def nonfinite(self) -> bool:
        """The step's loss or a gradient was NaN or infinite (on some rank): it updated nothing."""
        return bool(self.host["nonfinite"])

    def packed(self) -> dict[str, np.ndarray]:
        """The `Gradients` frame's tensors, packed on the device (`ValueCodec.pack_tensors`)."""
        return {key: self.host[key].numpy() for key in self.grad_keys}


class StepMath:
    """The dense model's steps on one rank (module docstring). `sync` and `optimizer` are set by the trainer
    once the group is formed (`DenseGroup.setup`), and again when it re-forms."""

    def __init__(self, model: torch.nn.Module, env: DistEnv, training: TrainingConfig, tasks: Tasks,
                 pooler: Pooler):
        self.env, self.training, self.tasks, self.pooler = env, training, tasks, pooler
        self.num_tasks = tasks.count
        self.model = model.to(env.device)
        self.feed = DeviceFeed(env.device, overlap=training.overlap_copies)
        self.sync: DenseSync | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.decay: LrDecay | None = None  # the learning rate's fall over the run's last steps (lr_decay.py)
        self._one = torch.ones(1, device=env.device)
        self.captured = None
        """The step as CUDA graphs (`training.capture` on a GPU: services/nn_worker/captured.py); None: eager."""
        if training.capture and env.device.type == "cuda":
            from services.nn_worker.captured import CapturedStep

            self.captured = CapturedStep(self)

    def train(self, batch: DenseBatch, emb: BatchEmbeddings, step: int, lost: bool = False,
              out: Any = None) -> StepOutput:
        """Step number `step` on `batch` (of weight 0 for a `lost` batch: every rank runs the same collectives).
        On a GPU it returns once the step is queued: its gradients and loss reach the host behind
        `StepOutput.event`, so the next batch's copy overlaps this step's kernels. With a receiver's slot `out`
        (on the CPU) it writes the gradient frame there.

        A step whose loss or gradients are not finite on any rank (`nonfinite`) updates nothing: the fused
        optimizer skips its update on the device (its `found_inf`, as under a gradient scaler: no wait for the
        host), and the caller sends the embedding worker a discard instead of its gradients."""
        if self.captured is not None and not lost:
            captured = self.captured.train(batch, emb, step, out)
            if captured is not None:
                return captured
        dense, labels, staged = self.feed.stage(batch.dense, batch.labels, emb)
        leaves, embeddings = self.pooler.pool(staged, self.env.device, grad=True)
        with self.autocast():
            logits = self.logits(self.sync.module(dense, embeddings))
        loss = self.loss(logits, labels) * (0.0 if lost else 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = {dim: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for dim, leaf in leaves.items()}
        found = self.nonfinite(loss, grads)
        self.optimizer.found_inf = found.view(())
        if self.decay is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.decay.lr(step)
        self.optimizer.step()
        self.sync.after_step(step)
        # The gradients are quantised where they are (on a GPU: half the bytes come back), and the logits go to
        # the host with them, not before the backward: the progressive window takes them when they are there
        # (`Trainer._record`), so nothing here waits for the device.
        packed = Gradients.pack_tensors(self.pooler.values, grads)
        return self.finish(batch, {"loss": loss.detach(), "logits": logits.detach(), "nonfinite": found}, packed,
                           out)

    def finish(self, batch: DenseBatch, head: dict[str, torch.Tensor], packed: dict[str, torch.Tensor],
               out: Any = None, rows: dict[int, int] | None = None) -> StepOutput:
        """A step's `head` (loss, logits, the non-finite flag) and `packed` gradients (`Gradients.pack_tensors`)
        to the host, and with a receiver's slot `out` on the CPU the gradient frame written there. `rows`: each
        width's real row count where the gradients hold padding rows after them (a captured step), dropped."""
        host, event = self.feed.to_host({**head, **packed})
        keys = tuple(packed)
        if rows is not None:  # views of the copies: slicing reads nothing before the copy is done
            host.update(Gradients.cut_tensors({key: host[key] for key in keys}, rows))
        written = None
        if out is not None and event is None:
            written = (Gradients.encode_discard_into(out.writable, batch.batch_ref) if bool(host["nonfinite"]) else
                       Gradients.encode_packed_into(out.writable, batch.batch_ref,
                                                    {key: host[key].numpy() for key in keys}))
        return StepOutput(host, event, keys, out, written)

    def nonfinite(self, loss: torch.Tensor, grads: dict[int, torch.Tensor]) -> torch.Tensor:
        """1.0 (a (1,) tensor on the device) when the loss, an embedding gradient or a dense gradient is NaN or
        infinite on this rank or, where DDP keeps the replicas equal, on any rank: the ranks must agree, so one
        AllReduce of it joins the step's collectives (a rank's embedding gradients are its own; its dense ones
        are reduced already). Checked by the kernel a gradient scaler uses (every element, one pass per dtype,
        nothing waits for the host)."""
        found = torch.zeros(1, device=self.env.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for tensor in [loss.detach().reshape(1), *grads.values(),
                       *(p.grad for p in self.model.parameters() if p.grad is not None)]:
            by_dtype[tensor.dtype].append(tensor)
        for tensors in by_dtype.values():  # multiplies by 1: only `found` changes
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, self._one)
        if self.sync.synchronous:
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group_for(found))
        return found

    def embedding_gradients(self, batch: DenseBatch, emb: BatchEmbeddings) -> dict[int, np.ndarray]:
        """The batch's loss gradients with respect to its embedding rows only (a replayed update). The dense
        parameters are frozen meanwhile, so no gradient reaches them (nor DDP's hooks on them)."""
        dense, labels, staged = self.feed.stage(batch.dense, batch.labels, emb)
        leaves, embeddings = self.pooler.pool(staged, self.env.device, grad=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        for param in params:
            param.requires_grad_(False)
        try:
            with self.autocast():
                logits = self.logits(self.model(dense, embeddings))
            loss = self.loss(logits, labels)
            wanted = list(leaves.values())
            grads = torch.autograd.grad(loss, wanted, allow_unused=True)
        finally:
            for param in params:
                param.requires_grad_(True)
        host, event = self.feed.to_host({dim: g if g is not None else torch.zeros_like(leaf)
                                         for (dim, leaf), g in zip(leaves.items(), grads)})
        if event is not None:
            event.synchronize()  # a rare path (a replayed update): not worth overlapping
        return {dim: t.numpy() for dim, t in host.items()}

    @torch.no_grad()
    def predict(self, batch: DenseBatch, emb: BatchEmbeddings) -> np.ndarray:
        """The batch's predictions (a binary task's probability, a regression task's value): (B,), or (B, tasks)
        with several tasks."""
        dense, _, staged = self.feed.stage(batch.dense, None, emb)
        _, embeddings = self.pooler.pool(staged, self.env.device, grad=False)
        with self.autocast():
            logits = self.logits(self.model(dense, embeddings))
        return self.tasks.outputs(logits).cpu().numpy()

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The model's output as (B,) logits with one task, (B, tasks) with several."""
        return out.reshape(-1).float() if self.num_tasks == 1 else out.reshape(out.shape[0], self.num_tasks).float()

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss (`Tasks.loss`: each task's own, weighted by the samples' weights, or the user's)."""
        return self.tasks.loss(logits, labels)

    def autocast(self, cache_enabled: bool = True):
        """bf16 autocast of the dense model when training.precision asks for it (a no-op context otherwise);
        `cache_enabled` False under a CUDA graph's capture (cached casts would outlive it)."""
        return torch.autocast(self.env.device.type, dtype=torch.bfloat16, enabled=self.training.precision == "bf16",
                              cache_enabled=cache_enabled)


def make_dense_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    """The dense optimizer, fused: one kernel over every parameter rather than a few per parameter (on a GPU
    a few launches instead of dozens per step; on the CPU Adam's step took 0.04 ms against 0.11 for the
    hidden-[8] DNN, 0.12 against 0.33 for 256-128). The same update and the same state dict."""
    opt = config.optimizer.dense
    params = model.parameters()
    if opt.name == "adam":  # capturable: its step count and rate on the device, as a CUDA graph needs
        capturable = config.training.capture and next(model.parameters()).device.type == "cuda"
        return torch.optim.Adam(params, lr=opt.lr, weight_decay=opt.weight_decay, fused=True, capturable=capturable)
    if opt.name == "adagrad":
        return torch.optim.Adagrad(params, lr=opt.lr, weight_decay=opt.weight_decay, fused=True)
    return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay, fused=True)
