"""The model's inputs: features, the tables they read, how their bags are pooled; the dense model's class."""
from __future__ import annotations

import enum
from typing import Annotated, Any, Sequence

from pydantic import Field

from hybridrec.core.layouts.criteo_format import SPARSE_COLUMNS
from hybridrec.core.wire.ids import MAX_GROUPS
from hybridrec.core.config.section import Section


class Pooling(str, enum.Enum):
    SUM = "sum"  # sum of the bag's rows
    MEAN = "mean"  # sum divided by the bag length
    SQRTN = "sqrtn"  # sum divided by sqrt(bag length)
    NONE = "none"  # not pooled: the model gets the ordered sequence, (batch, max_len, width) and the lengths


class FeatureKind(str, enum.Enum):
    SCALAR = "scalar"  # one ID or none per sample: a TSV column, or a Parquet int64 / string column
    LIST = "list"  # a Parquet list column: a multi-hot bag (pooled), or an ordered sequence (pooling none)


class TableConfig(Section):
    """An embedding table that features read; several features may share one (their IDs share rows)."""

    name: str
    """How features name it (`features[].table`)."""
    group: Annotated[int, Field(ge=0, lt=MAX_GROUPS)]
    """Feature group: the top bits of the table's IDs (unique per table)."""
    dim: Annotated[int, Field(gt=0, le=4096)] = 16
    """Embedding width of the table's rows."""


class FeatureConfig(Section):
    """One ID-type feature: a column of the data and the embedding table it reads."""

    name: str
    """Feature name: the key of its embedding in the model's input (and, unless `column` is set, the column)."""
    column: str | None = None
    """Source column of the data (None: `name`). TSV: C1..C26."""
    table: str | None = None
    """Name of an entry of `tables` whose group and width the feature takes (None: `group` and `dim`)."""
    group: Annotated[int, Field(ge=0, lt=MAX_GROUPS)] | None = None
    """Feature group: the top bits of the feature's IDs; features of one group share rows (set this or
    `table`)."""
    dim: Annotated[int, Field(gt=0, le=4096)] = 16
    """Embedding width (with `table`: the table's)."""
    kind: FeatureKind = FeatureKind.SCALAR
    """scalar (one ID or none per sample) or list (a Parquet list column: a bag or a sequence)."""
    pooling: Pooling = Pooling.SUM
    """How a bag becomes one vector: sum, mean, sqrtn, or none (a list feature handed over as a sequence)."""
    max_len: Annotated[int, Field(gt=0, le=4096)] = 50
    """List features: longest bag or sequence kept; a longer list keeps its last (most recent) max_len
    elements and counts in the data loader's `truncated_rows`."""

    @property
    def source(self) -> str:
        """The data column the feature reads."""
        return self.column or self.name

    @property
    def sequence(self) -> bool:
        """Handed to the model unpooled, as an ordered sequence."""
        return self.pooling == Pooling.NONE


def ids_per_sample(features: Sequence[FeatureConfig]) -> int:
    """The most IDs one sample holds: one per scalar feature, `max_len` per list feature (a list is cut to its
    last max_len). What bounds a batch's frames (`hybridrec.core.wire.frames.bag_bytes`)."""
    return sum(f.max_len if f.kind == FeatureKind.LIST else 1 for f in features)


def criteo_features(dim: int = 16) -> list[FeatureConfig]:
    """The 26 Criteo categorical columns, one group each."""
    return [FeatureConfig(name=name, group=i, dim=dim) for i, name in enumerate(SPARSE_COLUMNS)]


def resolve_tables(tree: Any) -> Any:
    """Give every feature that names a table the table's group and width (before validation, so the
    features stay frozen models). An unknown table is left to `Config._check_features`, which names the key."""
    if not isinstance(tree, dict) or not isinstance(tree.get("tables"), list) or not isinstance(
            tree.get("features"), list):
        return tree
    tables = {t.get("name"): t for t in tree["tables"] if isinstance(t, dict)}
    features = []
    for feature in tree["features"]:
        if isinstance(feature, dict) and feature.get("table") in tables:
            table = tables[feature["table"]]
            feature = {**feature, "group": table.get("group"), "dim": table.get("dim", 16)}
        features.append(feature)
    return {**tree, "features": features}


class ModelConfig(Section):
    """The dense model every NN worker trains."""

    path: str = "hybridrec.models:DNN"
    """Import path `package.module:Class` of an nn.Module taking (dense, embeddings)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the module besides the feature description."""
