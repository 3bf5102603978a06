"""The base of every config section, and the error a bad config raises."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


class Section(BaseModel):
    # use_attribute_docstrings: the string under each field becomes its description (tests/unit/test_config.py
    # fails on a field without one), so the docs of every key live next to it, in one place.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
