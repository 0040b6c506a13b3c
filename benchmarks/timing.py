"""Wall-clock timing shared by the benchmarks."""
from __future__ import annotations

import statistics
import time


def timed(fn, rounds: int):
    """Median seconds of `rounds` calls of fn() and the last call's result."""
    times, out = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out
