"""Transparent huge pages for the cpu backend's big buffers.

The cpu backend's "device" and host buffers are plain process memory. With 4 KiB pages, a transfer engine's
single-copy syscalls (UCX cma's ``process_vm_readv``, what NIXL uses between processes on one host) and scattered
block copies spend much of their time walking page tables. On kernels whose THP ``defrag`` setting is ``madvise``
(the usual default), only advised memory gets 2 MiB pages when it is first touched.

So ``alloc`` gives a big buffer an anonymous mapping of its own, 2 MiB-aligned and marked with
``madvise(MADV_HUGEPAGE)`` before anything writes it, and the tensor unmaps it when its last reference goes. The
advice goes with it: advising memory that ``malloc`` handed out would leave the advice on its heap after the
buffer is freed, and small allocations would then get 2 MiB pages. Where the kernel has no THP the advice fails
and the buffer is used with plain pages.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # Linux's value where Python does not name it


def alloc(nbytes: int, min_bytes: int) -> torch.Tensor | None:
    """``nbytes`` as a uint8 tensor over a mapping of its own, starting on a 2 MiB boundary and advised huge
    pages; None when ``nbytes`` is under ``min_bytes`` (or two huge pages), for the caller to allocate as usual."""
    if nbytes < max(min_bytes, 2 * HUGE_PAGE):
        return None
    import torch

    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive; unmapped with the last tensor
    pad = -base.data_ptr() % HUGE_PAGE
    try:
        region.madvise(MADV_HUGEPAGE, pad, nbytes)
    except OSError:  # no THP in this kernel: plain pages
        pass
    return base[pad:pad + nbytes]
