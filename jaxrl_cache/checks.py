"""Argument checks shared by every public entry point: typed errors that name the argument.

Integers: Python or numpy ints (bools and floats refused, even 2.0). Reals: Python or numpy
ints/floats (bools refused), always finite (NaN and inf refused). Flags: Python or numpy bools
only (1 and "yes" refused).
"""
from __future__ import annotations

import math

import numpy as np


def as_count(value, name: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """`value` as a Python int in [minimum, maximum]."""
    if type(value) is int and minimum <= value and maximum is None:  # the common case
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r:.80}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def as_bool(value, name: str) -> bool:
    """`value` as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r:.80}")
    return bool(value)


def as_real(value, name: str, *, minimum: float | None = None, maximum: float | None = None,
            open_min: bool = False) -> float:
    """`value` as a finite Python float in [minimum, maximum] ((minimum, ...] if open_min)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} "
                        f"{value!r:.80}")
    given = value
    try:
        value = float(value)
    except OverflowError:  # an int past the float range (10**400): not finite either
        value = math.inf if value > 0 else -math.inf
        given = f"an integer of {abs(given).bit_length()} bits"  # str() stops at 4300 digits
    low_bad = minimum is not None and (value <= minimum if open_min else value < minimum)
    if not math.isfinite(value) or low_bad or (maximum is not None and value > maximum):
        low = "" if minimum is None else f"{'>' if open_min else '>='} {minimum}"
        high = "" if maximum is None else f"<= {maximum}"
        bounds = " and ".join(b for b in (low, high) if b)
        raise ValueError(f"{name} must be finite{' and ' + bounds if bounds else ''}, "
                         f"got {given if isinstance(given, str) else value}")
    return value
