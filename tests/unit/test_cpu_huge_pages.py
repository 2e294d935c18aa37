"""The cpu backend asks for transparent huge pages on its big buffers (``kvplane/backend/cpu/huge_pages.py``)."""

from __future__ import annotations

import pytest

from kvplane.backend.cpu import huge_pages
from kvplane.backend.cpu.backend import CpuBackend

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_available() -> bool:
    try:
        with open(THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds ``addr`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


needs_thp = pytest.mark.skipif(not _thp_available(), reason=f"this kernel has no transparent huge pages ({THP})")


@needs_thp
@pytest.mark.parametrize("alloc", ["alloc_host", "alloc_device"])
def test_a_big_buffer_is_advised_huge_pages_over_its_aligned_inside(alloc: str) -> None:
    backend = CpuBackend()
    buf = getattr(backend, alloc)(64 << 20)
    inside = -(-buf.data_ptr() // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    assert "hg" in _vm_flags(inside)  # hg: madvise(MADV_HUGEPAGE) covers this mapping


@needs_thp
def test_advise_returns_the_aligned_range_it_marked() -> None:
    import torch

    buf = torch.empty((16 << 20) + 12345, dtype=torch.uint8)
    got = huge_pages.advise(buf, 8 << 20)
    assert got is not None
    start, length = got
    assert start % huge_pages.HUGE_PAGE == 0 and length % huge_pages.HUGE_PAGE == 0
    assert buf.data_ptr() <= start and start + length <= buf.data_ptr() + buf.numel()


def test_a_small_buffer_is_left_alone() -> None:
    import torch

    assert huge_pages.advise(torch.empty(1 << 20, dtype=torch.uint8), 8 << 20) is None
    assert huge_pages.advise(torch.empty(16 << 20, dtype=torch.uint8), 32 << 20) is None
