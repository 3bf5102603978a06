"""On the NN worker: ShadowSync (Zheng et al. 2020) — dense replicas synchronised by a background thread.

The training step never waits for communication: each rank trains its own
replica, while a "shadow" thread repeatedly combines the replicas over a
separate Gloo process group (so its collectives never interleave with the
training thread's):

* ``ma`` — model averaging: x_i <- (1 - alpha) x_i + alpha * mean(x);
* ``easgd`` — elastic averaging with a centre copy x~ held identically by every
  rank (the role of rank 0 / a sync PS, replicated so no extra hop is needed):
  x_i <- x_i - alpha (x_i - x~);  x~ <- x~ + alpha * sum_i (x_i - x~);
* ``bmuf`` — block-wise model update filtering: the centre moves by a block
  momentum step towards the mean, x_i <- x~ + mu * delta (Nesterov).

Stopping is agreed collectively (a MIN all-reduce of a "keep going" flag before
each round), so every rank's thread runs the same number of collectives and
none is left waiting.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn

BMUF_MOMENTUM = 0.5


class ShadowSync:
    def __init__(self, model: nn.Module, env, *, algorithm: str, alpha: float, interval_s: float):
        self.model, self.world_size = model, env.world_size
        self.algorithm, self.alpha, self.interval_s = algorithm, alpha, interval_s
        self.group = dist.new_group(backend="gloo")  # collective call: made on every rank, in the same order
        self.params = list(model.parameters())
        with torch.no_grad():
            self.center = nn.utils.parameters_to_vector(self.params).detach().cpu().clone()
        self.delta = torch.zeros_like(self.center)
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shadow-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            keep_going = torch.tensor([0 if self._stop.is_set() else 1], dtype=torch.int32)
            dist.all_reduce(keep_going, op=dist.ReduceOp.MIN, group=self.group)
            if not keep_going.item():
                return
            self._round()
            self._stop.wait(self.interval_s)

    @torch.no_grad()
    def _round(self) -> None:
        local = nn.utils.parameters_to_vector(self.params).detach().cpu()
        alpha = self.alpha
        if self.algorithm == "easgd":
            diff = local - self.center
            total = diff.clone()
            dist.all_reduce(total, group=self.group)
            new_local = local - alpha * diff
            self.center += alpha * total
        else:
            mean = local.clone()
            dist.all_reduce(mean, group=self.group)
            mean /= self.world_size
            if self.algorithm == "ma":
                new_local = (1 - alpha) * local + alpha * mean
            else:  # bmuf
                self.delta = BMUF_MOMENTUM * self.delta + alpha * (mean - self.center)
                self.center += self.delta
                new_local = self.center + BMUF_MOMENTUM * self.delta
        # Apply only what this round changed, so gradient steps taken meanwhile are kept.
        current = nn.utils.parameters_to_vector(self.params).detach().cpu()
        nn.utils.vector_to_parameters((current + (new_local - local)).to(self.params[0].device), self.params)
        self.rounds += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
