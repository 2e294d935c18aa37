"""Timing helpers: kvplane and its baseline alternate rep by rep, so machine noise hits both alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(
    kvplane: Callable[[], None], baseline: Callable[[], None], reps: int, warmup: int = 1
) -> tuple[float, float]:
    """Median seconds of ``kvplane`` and ``baseline`` over ``reps`` alternating runs, after ``warmup``."""
    for _ in range(warmup):
        kvplane()
        baseline()
    ours, theirs = [], []
    for _ in range(reps):
        ours.append(timed(kvplane))
        theirs.append(timed(baseline))
    return statistics.median(ours), statistics.median(theirs)
