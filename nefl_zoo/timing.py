"""Wall-clock medians, shared by profiling, export, the runtime and the benchmarks.

Standard library only, so the torch-free runtime can use it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable, Mapping, TypeVar

K = TypeVar("K", bound=Hashable)


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``runs`` calls after ``warmup`` calls, in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def interleaved_median_ms(fns: Mapping[K, Callable[[], object]], rounds: int, runs: int = 1, warmup: int = 0,
                          warmup_rounds: int = 0) -> dict[K, float]:
    """Median ms of each of ``fns`` over ``rounds`` rounds that time every function in turn
    (:func:`median_ms` of ``runs`` calls after ``warmup``), after ``warmup_rounds`` untimed
    rounds, so that a change of machine load hits all of them alike."""
    times: dict[K, list[float]] = {key: [] for key in fns}
    for round_ in range(warmup_rounds + rounds):
        for key, fn in fns.items():
            ms = median_ms(fn, runs, warmup)
            if round_ >= warmup_rounds:
                times[key].append(ms)
    return {key: statistics.median(t) for key, t in times.items()}
