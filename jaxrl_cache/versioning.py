"""Policy version checks: versions are integers in [0, 2**31 - 1] that only move forward.

The bound is the int32 range end to end: TrainState stores the version as int32, the engine,
the radix cache and checkpoints use the same range, and `as_version` refuses anything outside
it before any state changes.
"""
from __future__ import annotations

import numbers

import numpy as np

from jaxrl_cache.errors import VersionError

MAX_VERSION = 2**31 - 1  # int32 max: TrainState.version is int32
MAX_POLICY_LAG = 1024  # an engine's reconcile walks the window's versions: O(lag)


def as_version(value, name: str = "version") -> int:
    """Returns `value` as a Python int in [0, MAX_VERSION]; accepts ints and integer 0-d
    arrays (jax or numpy).

    Raises TypeError for bools, floats and other non-integers, VersionError outside the range.
    """
    if type(value) is int and 0 <= value <= MAX_VERSION:  # the common case, checked first
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    if not isinstance(value, numbers.Integral):
        dtype = getattr(value, "dtype", None)
        if dtype is None or getattr(value, "shape", None) != () or not np.issubdtype(
                dtype, np.integer):
            raise TypeError(f"{name} must be an integer or 0-d integer array, got "
                            f"{type(value).__name__} {value!r:.80}")
    version = int(value)
    if not 0 <= version <= MAX_VERSION:
        raise VersionError(f"{name} must be >= 0 and <= {MAX_VERSION} (int32), got {version}")
    return version
