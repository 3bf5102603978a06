"""Layout of a uint64 feature ID: the feature group in the top bits, a 56-bit hash below.

Putting the group in the ID lets one PS table hold every group without
collisions between groups, and lets any process tell an ID's group from the ID.
"""
from __future__ import annotations

import numpy as np

GROUP_SHIFT = 56
MAX_GROUPS = 1 << (64 - GROUP_SHIFT)
VALUE_MASK = (1 << GROUP_SHIFT) - 1


def with_group(values: np.ndarray, group: int) -> np.ndarray:
    """IDs of `group` from arbitrary uint64 values (their top bits are replaced)."""
    if not 0 <= group < MAX_GROUPS:
        raise ValueError(f"feature group {group} is outside [0, {MAX_GROUPS})")
    values = np.asarray(values, dtype=np.uint64)
    return (values & np.uint64(VALUE_MASK)) | np.uint64(group << GROUP_SHIFT)


def group_of(ids: np.ndarray) -> np.ndarray:
    return (np.asarray(ids, dtype=np.uint64) >> np.uint64(GROUP_SHIFT)).astype(np.int64)
