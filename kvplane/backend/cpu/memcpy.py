"""Executing a copy plan on the host: the native batched memcpy, split over its persistent thread pool for
large plans (``kvplane/_native/memcpy.c``; no thread is created per call)."""

from __future__ import annotations

import os

from kvplane._native import optional
from kvplane.descriptors import CopyPlan
from kvplane.errors import BackendError

_memcpy, _IMPORT_ERROR = optional("_memcpy")

PARALLEL_MIN_BYTES = 8 << 20  # below this one thread is faster than waking more (memcpy.c applies it too)


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def copy_plan(plan: CopyPlan, threads: int | None = None, begin: int = 0, end: int = -1) -> None:
    """memcpy descriptors ``[begin, end)`` of ``plan`` (all by default); the GIL is released while bytes move."""
    if _memcpy is None:
        raise BackendError(
            f"kvplane's native memcpy is not built ({_IMPORT_ERROR}); reinstall with `pip install -e .` "
            f"on a machine with a C compiler"
        )
    n = threads if threads is not None else default_threads()
    _memcpy.copy_batch(plan.src, plan.dst, plan.length, n, begin, end)
