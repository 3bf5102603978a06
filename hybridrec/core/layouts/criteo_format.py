"""The Criteo sample format: its columns and how configured features map onto them.

Shared by the data loader (which parses the files), the synthetic data
generator (which writes them) and the CLI's preflight check (which rejects a
feature that names no column before any process starts), so the format is
written down once, outside any service.

One sample per line, tab-separated: a 0/1 label, NUM_DENSE integer columns
(I1..I13) and NUM_SPARSE categorical columns (C1..C26).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Feature(Protocol):
    """What `feature_columns` reads of a configured feature (`hybridrec.core.config.FeatureConfig`, which imports
    this module for the column names: the protocol keeps the two in one direction)."""

    name: str
    group: int

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
"""Fields of a line: the label, then the dense, then the categorical columns."""
DENSE_COLUMNS = tuple(f"I{i + 1}" for i in range(NUM_DENSE))
SPARSE_COLUMNS = tuple(f"C{i + 1}" for i in range(NUM_SPARSE))


def feature_columns(features: Sequence[Feature]) -> tuple[np.ndarray, list[int]]:
    """Criteo column index of each configured feature (named C1..C26), and the group of every column.

    Columns no feature reads keep their index as group. Raises ValueError naming the feature.
    """
    groups = list(range(NUM_SPARSE))
    columns = []
    for i, feature in enumerate(features):
        name = getattr(feature, "source", feature.name)  # the feature's column (its name unless `column` is set)
        if not (name.startswith("C") and name[1:].isdigit() and 1 <= int(name[1:]) <= NUM_SPARSE):
            raise ValueError(f"features.{i}: {name!r} is not a Criteo categorical column (C1..C{NUM_SPARSE})")
        column = int(name[1:]) - 1
        groups[column] = feature.group
        columns.append(column)
    return np.asarray(columns), groups
