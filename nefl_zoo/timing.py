"""Wall-clock medians, shared by profiling, export, the runtime and the benchmarks.

Standard library only, so the torch-free runtime can use it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


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
