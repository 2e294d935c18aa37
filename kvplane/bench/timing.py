"""Timing helpers: kvplane and its baseline alternate rep by rep, so machine noise hits both alike.

Every rep also records kvplane's CPU seconds (the process's, or the calling thread's where only that thread
works), so a row shows what kvplane costs the host beside how long it took.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MIN_REPS = 5  # every bench row: at least this many interleaved repetitions of each side

Clock = Callable[[], float]


@dataclass
class Samples:
    """Per-rep seconds of kvplane (wall and CPU) and of the baseline (wall), in the order they ran."""

    ours: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, ours: float, cpu: float, baseline: float) -> None:
        """One rep: kvplane's wall and CPU seconds, the baseline's wall seconds."""
        self.ours.append(ours)
        self.cpu.append(cpu)
        self.baseline.append(baseline)

    @property
    def reps(self) -> int:
        return min(len(self.ours), len(self.baseline))

    @property
    def median(self) -> float:
        return statistics.median(self.ours)

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu) if self.cpu else 0.0


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_cpu(fn: Callable[[], None], clock: Clock = time.process_time) -> tuple[float, float]:
    """(wall seconds, CPU seconds on ``clock``) of one call."""
    c0, w0 = clock(), time.perf_counter()
    fn()
    return time.perf_counter() - w0, clock() - c0


def interleave(
    kvplane: Callable[[], None],
    baseline: Callable[[], None],
    reps: int = MIN_REPS,
    *,
    warmup: int = 1,
    clock: Clock = time.process_time,
    settle_s: float = 0.0,
) -> Samples:
    """``reps`` alternating runs of ``kvplane`` and ``baseline`` after ``warmup`` untimed rounds.

    ``settle_s``: an untimed pause after each baseline run, for rows whose CPU figure must not include the
    baseline's leftovers (torch's OpenMP threads spin for about 8 ms of CPU after a parallel ``copy_``).
    """
    for _ in range(warmup):
        kvplane()
        baseline()
    s = Samples()
    for _ in range(max(reps, MIN_REPS)):
        time.sleep(settle_s)
        wall, cpu = timed_cpu(kvplane, clock)
        s.add(wall, cpu, timed(baseline))
    return s


def alternate(
    kvplane: Callable[[], None], baseline: Callable[[], None], reps: int, warmup: int = 1
) -> tuple[float, float]:
    """Median seconds of ``kvplane`` and ``baseline`` over ``reps`` alternating runs, after ``warmup``
    (the conformance suite's bandwidth report uses it; bench rows use ``interleave``)."""
    for _ in range(warmup):
        kvplane()
        baseline()
    ours, theirs = [], []
    for _ in range(reps):
        ours.append(timed(kvplane))
        theirs.append(timed(baseline))
    return statistics.median(ours), statistics.median(theirs)
