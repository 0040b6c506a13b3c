"""Timing shared by the benchmarks."""
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


def best_interleaved(runs: dict, rounds: int, clock=time.perf_counter) -> dict:
    """{name: fewest seconds of one call} over `rounds` rounds that call every fn of `runs`
    once each, in turn: a load change on a shared machine hits all of them alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
    return best
