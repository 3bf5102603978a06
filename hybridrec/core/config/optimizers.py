"""The embedding optimizer (applied by the PS) and the dense one (on the NN workers)."""
from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import Field

from hybridrec.core.config.section import Section


class EmbeddingOptimizer(str, enum.Enum):
    """The optimizers of embedding rows: the one list of their names (config, PS kernels, planner and CLI)."""

    SGD = "sgd"  # w -= lr * g; no state
    ADAGRAD = "adagrad"  # torch.optim.Adagrad (lr_decay=0); state: sum of squared gradients
    ADAM = "adam"  # torch.optim.Adam (L2 weight decay, not AdamW); state: m, v and a per-row step
    FTRL = "ftrl"  # FTRL-proximal as TensorFlow's ApplyFtrl; state: accumulator, linear
    ROWWISE_ADAGRAD = "rowwise_adagrad"  # FBGEMM's row-wise Adagrad; state: one sum of mean squared gradients

    def __str__(self) -> str:  # the name alone in messages and f-strings, not "EmbeddingOptimizer.SGD"
        return self.value


class EmbeddingOptimizerConfig(Section):
    """What the embedding PS applies to embedding rows.

    The PS stores take this model as it is (services/embedding_ps/optimizers.py
    holds the arithmetic), so a key added here reaches every shard unchanged.
    """

    name: EmbeddingOptimizer = EmbeddingOptimizer.ADAGRAD
    """Optimizer; Adam keeps a per-row step counter (rows are updated sparsely)."""
    lr: Annotated[float, Field(gt=0)] = 0.05
    """Learning rate."""
    eps: Annotated[float, Field(ge=0)] = 1e-10
    """Adagrad's and row-wise Adagrad's epsilon (torch default 1e-10)."""
    initial_accumulator_value: Annotated[float, Field(ge=0)] = 0.0
    """Initial Adagrad sum (row-wise: the row's one sum) / FTRL accumulator of a new row."""
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    """Adam first-moment decay."""
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    """Adam second-moment decay."""
    adam_eps: Annotated[float, Field(gt=0)] = 1e-8
    """Adam's epsilon."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """L2 penalty added to the gradient (torch semantics: g += weight_decay * w)."""
    lr_power: Annotated[float, Field(le=0)] = -0.5
    """FTRL learning-rate power (TensorFlow default -0.5)."""
    l1: Annotated[float, Field(ge=0)] = 0.0
    """FTRL L1 regularisation strength (drives weights to exactly 0)."""
    l2: Annotated[float, Field(ge=0)] = 0.0
    """FTRL L2 regularisation strength."""


class LrDecayConfig(Section):
    """The dense learning rate falls linearly over the run's last steps, so that the run ends on a settled model:
    at a constant rate its calibration wanders by several percent from step to step. Needs the run's length
    ahead: training.max_steps, or Parquet training files (their row counts)."""

    last: Annotated[float, Field(gt=0, le=1)] = 0.25
    """The fraction of the run's steps over which the rate falls."""
    to: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """The fraction of `lr` left at the last step."""


class DenseOptimizerConfig(Section):
    """The torch.optim optimizer of the dense model (on the NN workers)."""

    name: Literal["sgd", "adam", "adagrad"] = "adam"
    """torch.optim.SGD, Adam or Adagrad."""
    lr: Annotated[float, Field(gt=0)] = 1e-3
    """Learning rate."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """torch's weight_decay (L2 penalty added to the gradient)."""
    decay: LrDecayConfig | None = None
    """The learning rate's fall over the run's last steps (`{last: 0.25}`: over the last quarter, to 0); None:
    the rate stays `lr` throughout."""


class OptimizerConfig(Section):
    """Optimizers of the two halves of the model."""

    embedding: EmbeddingOptimizerConfig = Field(default_factory=EmbeddingOptimizerConfig)
    """Applied by the embedding PS to the rows it stores."""
    dense: DenseOptimizerConfig = Field(default_factory=DenseOptimizerConfig)
    """Applied by every NN worker to its dense replica after the AllReduce."""
