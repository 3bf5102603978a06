"""A model that raises after a few training steps: the launcher must name the dead NN worker."""
from torch import nn

from hybridrec.core.model.models import DNN


class FailAtStep(DNN):
    def __init__(self, *, step: int, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = step
        self.calls = 0

    def forward(self, dense, embeddings):
        if self.training:
            self.calls += 1
            if self.calls >= self.fail_at:
                raise RuntimeError(f"planted failure at step {self.fail_at}")
        return super().forward(dense, embeddings)


__all__ = ["FailAtStep", "nn"]
