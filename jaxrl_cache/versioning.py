"""Policy version checks: versions are non-negative integers that only move forward."""
from __future__ import annotations

import numbers

import numpy as np

from jaxrl_cache.errors import VersionError


def as_version(value, name: str = "version") -> int:
    """Returns `value` as a Python int; accepts ints and integer 0-d arrays (jax or numpy).

    Raises TypeError for bools, floats and other non-integers, VersionError for negatives.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    if not isinstance(value, numbers.Integral):
        dtype = getattr(value, "dtype", None)
        if dtype is None or getattr(value, "shape", None) != () or not np.issubdtype(
                dtype, np.integer):
            raise TypeError(f"{name} must be an integer or 0-d integer array, got "
                            f"{type(value).__name__} {value!r}")
    version = int(value)
    if version < 0:
        raise VersionError(f"{name} must be >= 0, got {version}")
    return version
