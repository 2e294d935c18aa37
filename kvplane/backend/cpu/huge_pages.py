"""Transparent huge pages for the cpu backend's big buffers.

The cpu backend's "device" and host buffers are plain process memory. With 4 KiB pages, a transfer engine's
single-copy syscalls (UCX cma's ``process_vm_readv``, what NIXL uses between processes on one host) and scattered
block copies spend much of their time walking page tables. On kernels whose THP ``defrag`` setting is ``madvise``
(the usual default), only advised memory gets 2 MiB pages when it is first touched, so ``advise`` marks the
2 MiB-aligned inside of a fresh buffer with ``madvise(MADV_HUGEPAGE)`` before anything writes it. Where the kernel
has no THP the call fails and nothing changes: the buffer is used as it is.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # Linux's value where Python does not name it
_libc = ctypes.CDLL(None, use_errno=True)


def advise(buf: torch.Tensor, min_bytes: int) -> tuple[int, int] | None:
    """Advise huge pages over ``buf``'s 2 MiB-aligned inside when it holds at least ``min_bytes``; return the
    advised ``(addr, length)``, or None when the buffer is too small or the kernel refused."""
    nbytes = buf.numel() * buf.element_size()
    if nbytes < max(min_bytes, 2 * HUGE_PAGE):
        return None
    start = -(-buf.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    stop = (buf.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if stop <= start:
        return None
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), MADV_HUGEPAGE) != 0:
        return None
    return start, stop - start
