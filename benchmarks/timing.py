"""Timing and report writing shared by the benchmarks."""
from __future__ import annotations

import json
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


def write_report(result: dict, json_path, md_path, markdown) -> None:
    """Writes `result` as JSON (json_path) and markdown(result) (md_path), each if given,
    and prints the markdown."""
    if json_path:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    if md_path:
        md_path.write_text(markdown(result))
    print(markdown(result))
