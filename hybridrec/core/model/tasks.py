"""The model's tasks: what each output is (a click or a value), how it trains, and how a batch's labels carry the
sample weights.

One owner for what `data.labels`, `data.weight_column` and `training.loss` mean once data is read: the NN
worker's training loss and predictions, and the eval metrics. A binary task trains with log loss on a logit and
answers the sigmoid of it, a probability; a regression task's value is offset + scale x its output (the
`data.labels` entry's), trained with MSE or Huber against the label and answered as it is. A batch's labels
are float32 (batch,) with one task and no weights, else (batch, columns): one column per task, then, with
`data.weight_column`, the weights (the readers append them: one array to frame, ship and slice, whatever the
task count).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hybridrec.core.config import Config, ConfigError, TaskConfig
from hybridrec.core.model.evaluation import binary_metrics, regression_metrics

LossFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def load_loss(path: str) -> LossFunction:
    """The function `module:function` names (`training.loss`); ConfigError naming the key when it does not
    import or is not callable."""
    module_name, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except Exception as exc:  # an import can raise anything; the message says what
        raise ConfigError(f"training.loss: {path!r} does not import: {type(exc).__name__}: {exc}") from exc
    if not callable(function):
        raise ConfigError(f"training.loss: {path!r} is a {type(function).__name__}, not a function")
    return function


def answers(out: torch.Tensor, heads: Sequence[TaskConfig]) -> torch.Tensor:
    """A model's answers from its raw outputs, float32, by each output's task (`heads`): the sigmoid of a binary
    task's output (a probability), offset + scale x a regression task's (its value). `out` is (batch,) or
    (batch, 1) with one task, (batch, tasks) with several; training's eval, `hybridrec predict` and both serving
    engines answer through this. An empty `heads`: every output binary."""
    out = out.float()
    if all(h.binary for h in heads):
        return torch.sigmoid(out)
    offset = torch.tensor([h.offset for h in heads], device=out.device)
    scale = torch.tensor([h.scale for h in heads], device=out.device)
    values = out * scale + offset if out.ndim == 2 else out * scale[0] + offset[0]
    if not any(h.binary for h in heads):
        return values
    return torch.where(torch.tensor([h.binary for h in heads], device=out.device), torch.sigmoid(out), values)


@dataclass(frozen=True)
class Tasks:
    """The job's tasks (`data.labels`), whether its labels carry weights, and the loss they train with."""

    specs: tuple[TaskConfig, ...]
    weighted: bool
    task_weights: tuple[float, ...]
    custom: LossFunction | None = None
    custom_name: str | None = None

    @classmethod
    def from_config(cls, config: Config, load: bool = True) -> "Tasks":
        """`load`: import `training.loss` (the NN workers do; a caller that only splits labels need not)."""
        specs = tuple(config.data.tasks)
        path = config.training.loss
        return cls(specs, config.data.weight_column is not None,
                   tuple(config.training.task_weights or [1.0] * len(specs)),
                   load_loss(path) if path and load else None, path)

    @property
    def count(self) -> int:
        return len(self.specs)

    def split(self, labels: np.ndarray | torch.Tensor):
        """A batch's labels as (labels, weights): labels (batch,) with one task, (batch, tasks) with several;
        weights (batch,), or None without a weight column."""
        if not self.weighted:
            return labels, None
        task_labels = labels[:, 0] if self.count == 1 else labels[:, :self.count]
        return task_labels, labels[:, self.count]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch's outputs against its labels (weight column included): the user's
        function, or each task's own loss, a weighted mean over the samples, summed over tasks times
        `training.task_weights`."""
        task_labels, weights = self.split(labels)
        if self.custom is not None:
            if weights is None:
                weights = torch.ones(task_labels.shape[0], dtype=task_labels.dtype, device=task_labels.device)
            return self._checked(self.custom(logits, task_labels, weights))
        if self.count == 1:
            return self._task_loss(self.specs[0], logits, task_labels, weights)
        total = logits.new_zeros(())
        for t, spec in enumerate(self.specs):
            total = total + self.task_weights[t] * self._task_loss(spec, logits[:, t], task_labels[:, t], weights)
        return total

    @staticmethod
    def _task_loss(spec: TaskConfig, out: torch.Tensor, labels: torch.Tensor,
                   weights: torch.Tensor | None) -> torch.Tensor:
        """One task's loss: the mean over the batch, weighted by the samples' weights (sum of weight times loss
        over sum of weights: a batch of weights 1 gives the unweighted mean exactly); a regression task's of its
        value, offset + scale x the output."""
        name = spec.loss_name
        if not spec.binary and (spec.offset, spec.scale) != (0.0, 1.0):
            out = out * spec.scale + spec.offset  # the task's value, in the label's units
        loss = (F.binary_cross_entropy_with_logits if name == "bce" else F.mse_loss if name == "mse" else
                functools.partial(F.huber_loss, delta=spec.huber_delta))
        if weights is None:
            return loss(out, labels)
        per = loss(out, labels, reduction="none")
        return (per * weights).sum() / weights.sum().clamp_min(torch.finfo(per.dtype).tiny)

    def probe(self) -> None:
        """Run the user's loss once on a batch of two samples (outputs 0, labels 0 and 1, weights 1), before
        training: ConfigError naming `training.loss` when it raises, or returns what `_checked` refuses, or a
        value that is not finite or not differentiable in the outputs. A no-op with the built-in losses."""
        if self.custom is None:
            return
        shape = (2,) if self.count == 1 else (2, self.count)
        logits = torch.zeros(shape, requires_grad=True)
        labels = torch.tensor([0.0, 1.0]).reshape(2, *([1] * (len(shape) - 1))).expand(shape).contiguous()
        try:
            answer = self.custom(logits, labels, torch.ones(2))
        except Exception as exc:  # the user's code can raise anything; the message says what
            raise ConfigError(f"training.loss: {self.custom_name} failed: {type(exc).__name__}: {exc}") from None
        try:
            loss = self._checked(answer)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not bool(torch.isfinite(loss)):
            raise ConfigError(f"training.loss: {self.custom_name} returned {float(loss)} on outputs of 0")
        try:
            loss.backward()
        except Exception as exc:  # not differentiable in the outputs (a detached result, a custom op)
            raise ConfigError(f"training.loss: {self.custom_name} failed: {type(exc).__name__}: {exc}") from None

    def _checked(self, loss) -> torch.Tensor:
        """The user's loss, refused (naming `training.loss`) unless it is a scalar tensor; whether it is finite
        is the step's non-finite check (`training.on_nonfinite`), as for the built-in losses."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
            what = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor)
                    else f"a {type(loss).__name__}")
            raise ValueError(f"training.loss: {self.custom_name} returned {what}, not a floating-point scalar "
                             f"tensor")
        return loss.reshape(())

    def outputs(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's answers from its raw outputs (`answers`)."""
        return answers(logits, self.specs)

    def metrics(self, t: int, labels: np.ndarray, predictions: np.ndarray,
                weights: np.ndarray | None) -> dict[str, float | None]:
        """Task t's eval metrics: AUC and log loss, or RMSE and MAE (weighted with `weights`)."""
        if self.specs[t].binary:
            return binary_metrics(labels, predictions, weights)
        return regression_metrics(labels, predictions, weights)
