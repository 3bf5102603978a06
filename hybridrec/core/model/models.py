"""The model API and the example models: DNN, DLRM, and for multi-task and sequence inputs MMoE and DIN.

A hybridrec model is any `torch.nn.Module` named in the config by import path
(`package.module:Class`). It is constructed as

    Model(features=[FeatureInfo(name, dim, sequence, max_len), ...], num_dense=13, **model.kwargs)

(plus `num_tasks=T` when `data.labels` lists T > 1 label columns) and called
as `model(dense, embeddings)` with `dense` a float tensor (batch, num_dense)
and `embeddings` a dict from feature name to its pooled embedding (batch, dim),
in the config's feature order; a feature with `pooling: none` arrives as a
`SeqEmbedding` (values (batch, max_len, dim), oldest first, and lengths). It
returns one logit per sample and task: (batch,) or (batch, 1) with one task,
(batch, T) with several. The embedding tables themselves are not part of the
module: they live on the PS and arrive already pooled (or gathered).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


from hybridrec.core.model.pooling import PooledEmbeddings, SeqEmbedding

__all__ = ["FeatureInfo", "feature_infos", "ModelImportError", "import_model_class", "build_model", "mlp",
           "side_by_side", "vector", "PooledEmbeddings", "SeqEmbedding", "DNN", "DLRM", "TargetAttention",
           "HistoryReader", "DIN", "MMoE"]
"""The model API: users import it as `hybridrec.models` (hybridrec/models.py re-exports exactly these)."""


@dataclass(frozen=True)
class FeatureInfo:
    name: str
    dim: int
    sequence: bool = False
    """Arrives unpooled, as a `SeqEmbedding` (pooling: none)."""
    max_len: int = 0
    """A sequence's padded length."""


def feature_infos(features) -> list[FeatureInfo]:
    """What a model is told about the configured features."""
    return [FeatureInfo(f.name, f.dim, f.sequence, f.max_len if f.sequence else 0) for f in features]


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


def build_model(path: str, features: list[FeatureInfo], num_dense: int, kwargs: dict, *,
                num_tasks: int = 1) -> nn.Module:
    """The configured model; `num_tasks` is passed only when above 1, so single-task models need not take it."""
    cls = import_model_class(path)
    extra = {"num_tasks": num_tasks} if num_tasks > 1 else {}
    try:
        return cls(features=features, num_dense=num_dense, **kwargs, **extra)
    except TypeError as exc:
        raise ModelImportError(f"model {path} rejected its arguments (model.kwargs={kwargs}): {exc}") from None


def mlp(sizes: list[int], *, last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def side_by_side(embeddings: dict, names: list[str]) -> torch.Tensor:
    """(batch, sum of widths): the named features' vectors side by side, in that order. Free where the pooler
    made them one block (`hybridrec.core.model.pooling.PooledEmbeddings`), a concatenation otherwise (a plain dict, a
    sequence's mean)."""
    if isinstance(embeddings, PooledEmbeddings):
        return embeddings.side_by_side(names, vector)
    return torch.cat([vector(embeddings[n]) for n in names], dim=1)


def vector(embedding: torch.Tensor | SeqEmbedding) -> torch.Tensor:
    """A feature's (batch, dim) vector: pooled as it came, or a sequence's mean over its elements."""
    if isinstance(embedding, SeqEmbedding):
        return embedding.values.sum(dim=1) / embedding.lengths.clamp(min=1).unsqueeze(-1).to(embedding.values.dtype)
    return embedding


class DNN(nn.Module):
    """MLP over the concatenated pooled embeddings and dense features (a sequence feature: its mean)."""

    def __init__(self, *, features: list[FeatureInfo], num_dense: int, hidden: list[int] = (512, 256, 128),
                 num_tasks: int = 1):
        super().__init__()
        self.names = [f.name for f in features]
        self.num_dense = num_dense  # a constant, not dense.shape[1]: an exported graph folds the weight's split
        width = sum(f.dim for f in features) + num_dense
        self.net = mlp([width, *hidden, num_tasks], last_activation=False)

    def forward(self, dense: torch.Tensor, embeddings: dict[str, torch.Tensor]) -> torch.Tensor:
        # The first layer over [dense, embeddings] as two products with its weight's two column blocks: the
        # pooled embeddings come as one block (`side_by_side`), so nothing is concatenated, forward or back.
        # Each column block is copied contiguous first (a few kB): MKL's products with a strided weight took
        # 1.8 + 2.6 ms forward and back against 1.4 + 1.1 at width 8 on the development machine's CPU.
        first, *rest = self.net
        n = self.num_dense
        x = F.linear(side_by_side(embeddings, self.names), first.weight[:, n:].contiguous()) + \
            F.linear(dense, first.weight[:, :n].contiguous(), first.bias)
        for layer in rest:
            x = layer(x)
        return x.squeeze(-1)


class DLRM(nn.Module):
    """DLRM-style: a bottom MLP maps dense features to the embedding width, then pairwise dot
    products of all vectors (dense + every feature) feed a top MLP. All features must share one width."""

    def __init__(self, *, features: list[FeatureInfo], num_dense: int, bottom: list[int] = (64, 32),
                 top: list[int] = (256, 128), num_tasks: int = 1):
        super().__init__()
        dims = {f.dim for f in features}
        if len(dims) != 1:
            raise ValueError(f"DLRM needs one embedding width for every feature, got {sorted(dims)}")
        dim = dims.pop()
        self.names = [f.name for f in features]
        self.bottom = mlp([num_dense, *bottom, dim])
        n = len(features) + 1
        self.pairs = torch.triu_indices(n, n, offset=1)
        self.top = mlp([dim + n * (n - 1) // 2, *top, num_tasks], last_activation=False)

    def forward(self, dense: torch.Tensor, embeddings: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *(vector(embeddings[n]) for n in self.names)], dim=1)  # (B, n, dim)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(-1)



class TargetAttention(nn.Module):
    """DIN's activation unit (Zhou et al., KDD 2018): each element of a sequence is weighted by an MLP of
    (target, element, target * element, target - element, the element's recency), and the weighted elements
    are summed (no softmax, as in DIN, so the weight mass says how much of the history matches).

    The recency embedding (position counted back from the newest element) lets the weights fall with age:
    the synthetic multi-task data plants an effect that does (hybridrec/app/data/synth_parquet.py)."""

    def __init__(self, dim: int, max_len: int, hidden: list[int] = (64, 32)):
        super().__init__()
        self.recency = nn.Embedding(max_len, dim)
        self.score = mlp([5 * dim, *hidden, 1], last_activation=False)

    def forward(self, target: torch.Tensor, seq: SeqEmbedding) -> torch.Tensor:
        values, lengths = seq
        batch, max_len, dim = values.shape
        steps = torch.arange(max_len, device=values.device).unsqueeze(0)
        valid = steps < lengths.unsqueeze(1)
        age = (lengths.unsqueeze(1) - 1 - steps).clamp(min=0)  # 0: the newest element
        q = target.unsqueeze(1).expand(-1, max_len, -1)
        scores = self.score(torch.cat([q, values, q * values, q - values, self.recency(age)], dim=-1)).squeeze(-1)
        return ((scores * valid.to(scores.dtype)).unsqueeze(-1) * values).sum(dim=1)


class HistoryReader(nn.Module):
    """A sequence feature read for a target: by `TargetAttention` when it arrives unpooled, else as the vector
    the config pooled it into. Gives [history, history * target] (2 * dim), the DIN-style interaction."""

    def __init__(self, features: list[FeatureInfo], sequence: str, target: str, hidden: list[int] = (64, 32)):
        super().__init__()
        by_name = {f.name: f for f in features}
        for key, name in (("sequence", sequence), ("target", target)):
            if name not in by_name:
                raise ValueError(f"model.kwargs.{key}: no feature {name!r}")
        seq, tgt = by_name[sequence], by_name[target]
        if seq.dim != tgt.dim:
            raise ValueError(f"model.kwargs: {sequence!r} and {target!r} need one width, got {seq.dim}, {tgt.dim}")
        self.sequence, self.target, self.dim = sequence, target, seq.dim
        self.attention = TargetAttention(seq.dim, seq.max_len, hidden) if seq.sequence else None

    def forward(self, embeddings: dict) -> torch.Tensor:
        seq, target = embeddings[self.sequence], embeddings[self.target]
        history = self.attention(target, seq) if self.attention is not None else vector(seq)
        return torch.cat([history, history * target], dim=1)


class DIN(nn.Module):
    """DIN-style: target attention over a sequence feature, then an MLP over [dense, every other feature,
    the attended history, history * target].

    `sequence` names the sequence feature, `target` the feature whose embedding queries it (the two should
    share a table). Configured with the sequence pooled (pooling sum, say) instead of `none`, the same model
    uses the pooled vector where the attended one would be: the comparison that shows what attention adds."""

    def __init__(self, *, features: list[FeatureInfo], num_dense: int, sequence: str, target: str,
                 hidden: list[int] = (256, 128), attention_hidden: list[int] = (64, 32), num_tasks: int = 1):
        super().__init__()
        self.reader = HistoryReader(features, sequence, target, attention_hidden)
        self.others = [f.name for f in features if f.name != sequence]
        width = num_dense + sum(f.dim for f in features if f.name != sequence) + 2 * self.reader.dim
        self.net = mlp([width, *hidden, num_tasks], last_activation=False)

    def forward(self, dense: torch.Tensor, embeddings: dict) -> torch.Tensor:
        x = torch.cat([dense, *(vector(embeddings[n]) for n in self.others), self.reader(embeddings)], dim=1)
        return self.net(x).squeeze(-1)


class MMoE(nn.Module):
    """Multi-gate mixture of experts (Ma et al., KDD 2018): experts share the input, each task mixes them
    with its own softmax gate and has its own tower; one logit per task, (batch, num_tasks).

    The input is [dense, every feature's vector]; with `sequence` and `target` set, the sequence is read by
    DIN's target attention (`HistoryReader`), else a sequence feature is mean-pooled."""

    def __init__(self, *, features: list[FeatureInfo], num_dense: int, num_tasks: int = 2, num_experts: int = 4,
                 expert_hidden: list[int] = (256, 128), tower_hidden: list[int] = (64,),
                 sequence: str | None = None, target: str | None = None, attention_hidden: list[int] = (64, 32)):
        super().__init__()
        if (sequence is None) != (target is None):
            raise ValueError("model.kwargs: sequence and target go together (the feature read, the one querying)")
        self.reader = HistoryReader(features, sequence, target, attention_hidden) if sequence else None
        self.names = [f.name for f in features if f.name != sequence]
        width = num_dense + sum(f.dim for f in features if f.name != sequence) + (
            2 * self.reader.dim if self.reader else 0)
        self.experts = nn.ModuleList(mlp([width, *expert_hidden]) for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(width, num_experts) for _ in range(num_tasks))
        self.towers = nn.ModuleList(mlp([expert_hidden[-1], *tower_hidden, 1], last_activation=False)
                                    for _ in range(num_tasks))

    def forward(self, dense: torch.Tensor, embeddings: dict) -> torch.Tensor:
        parts = [dense, *(vector(embeddings[n]) for n in self.names)]
        if self.reader is not None:
            parts.append(self.reader(embeddings))
        x = torch.cat(parts, dim=1)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # (B, experts, out)
        outputs = [tower((torch.softmax(gate(x), dim=-1).unsqueeze(-1) * experts).sum(dim=1))
                   for gate, tower in zip(self.gates, self.towers)]
        return torch.cat(outputs, dim=1)
