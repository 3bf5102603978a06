"""Layout of a uint64 feature ID: the feature group in the top bits, a 56-bit hash below.

Putting the group in the ID lets one PS table hold every group without
collisions between groups, and lets any process tell an ID's group from the ID.
"""
from __future__ import annotations

GROUP_SHIFT = 56
MAX_GROUPS = 1 << (64 - GROUP_SHIFT)
VALUE_MASK = (1 << GROUP_SHIFT) - 1
