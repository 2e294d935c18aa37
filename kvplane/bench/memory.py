"""Keeps memory a bench row freed inside the bench process, so the next row reuses pages already faulted in.

Every row allocates gigabytes (device caches, host pools, flat baseline buffers). glibc hands allocations
this large to ``mmap`` and returns them to the kernel on ``free``, so each row paid the first-touch page faults
again: a default run took 7.4 million page faults (30 GB) and 50 of its 123 seconds were system time. Inside
``freed_memory_kept()`` glibc serves every allocation from its heap and never trims it, so the process holds its
peak footprint while the rows run; on exit the defaults come back and the heap is trimmed. The runner keeps it
on for rows whose buffers live in the bench process (offload, overhead, store) and off for the rest (P/D rows:
engines and their threads allocate as they would in an engine). Timed reps work on
memory touched before them either way, so no figure changes, only the setup between reps gets shorter.
Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NO_TRIM = 2**31 - 1  # bytes free at the top of the heap before glibc gives them back: never, in practice
_DEFAULT_TRIM = 128 * 1024  # glibc's defaults (malloc(3))
_DEFAULT_MMAP_MAX = 65536


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return None
    return libc


@contextmanager
def freed_memory_kept() -> Iterator[bool]:
    """Within the block, freed memory stays in the process for reuse; yields whether that took effect."""
    libc = _libc()
    kept = libc is not None and bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _NO_TRIM))
    try:
        yield kept
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
            libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
            libc.malloc_trim(0)
