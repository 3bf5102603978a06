"""Embedding optimizers of the PS: their typed spec and state layout.

On the embedding PS: every row of a store holds its embedding followed by the
optimizer state (`state_width(dim)` float32 values). The arithmetic itself is
in `kernels._apply_row` (float32, torch's operation order), so that the same
row is updated in place while only its stripe is locked.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from services.embedding_ps import kernels as K

OPTIMIZER_CODES: dict[str, int] = {
    "sgd": K.OPT_SGD,          # w -= lr * g; no state
    "adagrad": K.OPT_ADAGRAD,  # torch.optim.Adagrad (lr_decay=0); state: sum of squared gradients
    "adam": K.OPT_ADAM,        # torch.optim.Adam (L2 weight decay, not AdamW); state: m, v, per-row step
    "ftrl": K.OPT_FTRL,        # FTRL-proximal as TensorFlow's ApplyFtrl; state: accumulator, linear
}


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer the PS applies to embedding rows, and its hyper-parameters."""

    name: Literal["sgd", "adagrad", "adam", "ftrl"]
    """Optimizer; Adam keeps a per-row step counter (rows are updated sparsely)."""
    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-10
    """Adagrad's epsilon (torch default 1e-10)."""
    initial_accumulator_value: float = 0.0
    """Initial Adagrad sum / FTRL accumulator of a new row."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient (torch semantics: g += weight_decay * w)."""
    lr_power: float = -0.5
    """FTRL learning-rate power (TensorFlow default)."""
    l1: float = 0.0
    """FTRL L1 regularisation."""
    l2: float = 0.0
    """FTRL L2 regularisation."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_CODES:
            raise ValueError(f"optimizer name must be one of {sorted(OPTIMIZER_CODES)}, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"optimizer lr must be > 0, got {self.lr}")
        for field in ("eps", "adam_eps", "weight_decay", "initial_accumulator_value", "l1", "l2"):
            if getattr(self, field) < 0:
                raise ValueError(f"optimizer {field} must be >= 0, got {getattr(self, field)}")
        for field in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"optimizer {field} must be in [0, 1), got {getattr(self, field)}")
        if self.lr_power > 0:
            raise ValueError(f"optimizer lr_power must be <= 0, got {self.lr_power}")

    @property
    def code(self) -> int:
        return OPTIMIZER_CODES[self.name]

    def state_width(self, dim: int) -> int:
        """float32 values of optimizer state stored after a row's `dim` weights."""
        return {"sgd": 0, "adagrad": dim, "adam": 2 * dim + 1, "ftrl": 2 * dim}[self.name]

    def hyper_parameters(self, weight_bound: float | None) -> np.ndarray:
        """The float64 vector the update kernel reads (indices `kernels.HP_*`); NaN bound = none."""
        hp = np.zeros(K.NUM_HP, np.float64)
        hp[K.HP_LR] = self.lr
        hp[K.HP_EPS] = self.eps
        hp[K.HP_BETA1] = self.beta1
        hp[K.HP_BETA2] = self.beta2
        hp[K.HP_ADAM_EPS] = self.adam_eps
        hp[K.HP_WD] = self.weight_decay
        hp[K.HP_LR_POWER] = self.lr_power
        hp[K.HP_L1] = self.l1
        hp[K.HP_L2] = self.l2
        hp[K.HP_BOUND] = np.nan if weight_bound is None else weight_bound
        hp[K.HP_INIT_ACC] = self.initial_accumulator_value
        return hp

    def to_dict(self) -> dict:
        """Plain data for manifests (checkpoint) and stats."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "OptimizerSpec":
        return cls(**data)
