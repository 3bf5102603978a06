"""The model API and two example models.

A hybridrec model is any `torch.nn.Module` named in the config by import path
(`package.module:Class`). It is constructed as

    Model(features=[FeatureInfo(name, dim), ...], num_dense=13, **model.kwargs)

and called as `model(dense, embeddings)` with `dense` a float tensor
(batch, num_dense) and `embeddings` a dict from feature name to its pooled
embedding (batch, dim), in the config's feature order. It returns one logit per
sample, shape (batch,) or (batch, 1). The embedding tables themselves are not
part of the module: they live on the PS and arrive already pooled.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FeatureInfo:
    name: str
    dim: int


class ModelImportError(ValueError):
    """The configured model path cannot be imported or is not an nn.Module class."""


def import_model_class(path: str) -> type[nn.Module]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ModelImportError(f"model.path {path!r}: expected 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelImportError(f"model.path {path!r}: cannot import module {module_name!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ModelImportError(f"model.path {path!r}: {attr!r} is not an nn.Module class in {module_name}")
    return cls


def build_model(path: str, features: list[FeatureInfo], num_dense: int, kwargs: dict) -> nn.Module:
    cls = import_model_class(path)
    try:
        return cls(features=features, num_dense=num_dense, **kwargs)
    except TypeError as exc:
        raise ModelImportError(f"model {path} rejected its arguments (model.kwargs={kwargs}): {exc}") from None


def mlp(sizes: list[int], *, last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DNN(nn.Module):
    """MLP over the concatenated pooled embeddings and dense features."""

    def __init__(self, *, features: list[FeatureInfo], num_dense: int, hidden: list[int] = (512, 256, 128)):
        super().__init__()
        self.names = [f.name for f in features]
        width = sum(f.dim for f in features) + num_dense
        self.net = mlp([width, *hidden, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, embeddings: dict[str, torch.Tensor]) -> torch.Tensor:
        x = torch.cat([dense, *(embeddings[n] for n in self.names)], dim=1)
        return self.net(x).squeeze(-1)


class DLRM(nn.Module):
    """DLRM-style: a bottom MLP maps dense features to the embedding width, then pairwise dot
    products of all vectors (dense + every feature) feed a top MLP. All features must share one width."""

    def __init__(self, *, features: list[FeatureInfo], num_dense: int, bottom: list[int] = (64, 32),
                 top: list[int] = (256, 128)):
        super().__init__()
        dims = {f.dim for f in features}
        if len(dims) != 1:
            raise ValueError(f"DLRM needs one embedding width for every feature, got {sorted(dims)}")
        dim = dims.pop()
        self.names = [f.name for f in features]
        self.bottom = mlp([num_dense, *bottom, dim])
        n = len(features) + 1
        self.pairs = torch.triu_indices(n, n, offset=1)
        self.top = mlp([dim + n * (n - 1) // 2, *top, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, embeddings: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *(embeddings[n] for n in self.names)], dim=1)  # (B, n, dim)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(-1)
