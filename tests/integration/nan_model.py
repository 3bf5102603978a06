"""A model that makes a NaN on one rank at one training step: the NN workers' guard must leave the dense model, the
PS rows and every checkpoint finite, the step counted (tests/integration/test_nonfinite.py)."""
import torch
import torch.distributed as dist

from hybridrec.core.model.models import DNN


class NaNAtStep(DNN):
    def __init__(self, *, step: int, rank: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.nan_at, self.nan_rank = step, rank
        self.calls = 0

    def forward(self, dense, embeddings):
        out = super().forward(dense, embeddings)
        if torch.is_grad_enabled():  # a training step's forward (evaluation runs without gradients)
            self.calls += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            if self.calls == self.nan_at and rank == self.nan_rank:
                out = out * float("nan")
        return out
